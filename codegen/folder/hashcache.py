"""A shard's digest without reading the shard again.

`export` records each shard's digest in manifest.json and `verify`/`run` check it
(`codegen.folder.integrity`): a sha256 when one is known without reading the shard, else a
BLAKE3 (`codegen.folder.filehash`: 4-5 GB/s a core, holes not read). Shortcuts make it nearly
free, and any other file is read:
- A Hugging Face cache blob (`models--org--name/blobs/<64 hex>`, the snapshot's file a symlink
  to it) is an LFS file named by the sha256 of its content (git blobs have 40-hex sha1 names
  and are read). Export hard-links the blob, so its hash is known before a byte is read.
- `huggingface-cli download --local-dir` writes `.cache/huggingface/download/<file>.metadata`
  beside the files: commit, etag (an LFS file's sha256) and the time it was written. As
  huggingface_hub (`_local_folder.read_download_metadata`) trusts it, so does export: when the
  etag is 64 hex and the file's mtime is at most 1 s after that time (a later write is not
  covered: the file is read). The metadata records no size.
- `digests.json` in the project's cache folder ($GEMMA4_QAIC_CACHE, else ~/.cache/gemma4-qaic,
  where the default model also lives) maps (algorithm, st_dev, st_ino) to the
  (st_size, st_mtime_ns, digest) the file had when hashed; a file whose size and mtime still
  match is not read. The export folder's shards are hard links of the checkpoint's (one inode),
  so `verify` and `run` after an export, and the next export of that checkpoint, read nothing.

The key leaves st_ctime out on purpose: making or removing a hard link changes it, and every
export links the shards (and `--force` then unlinks the previous export's), so a ctime key
would re-read the whole checkpoint after each export. The price: a same-size in-place rewrite
that restores mtime to the nanosecond (`os.utime`, `touch -d`, `cp -p` from a file with the
same mtime) keeps the old hash; delete digests.json to have every shard read again. DVC's state
database, whose workspace files are often hard links into its cache, checks the same (inode,
mtime, size) (dvc/state.py `_file_metadata_changed`). A blob's name or local-dir metadata is
trusted only at export: `verify` checks the record made then, which an edit of the file (new
mtime) no longer matches. Files under MIN_BYTES are always read (milliseconds), and a file
modified in the last RECENT_NS is read and not recorded. The cache is an optimization: an
unreadable or malformed digests.json counts as empty, and one that cannot be written is left as
it is.
"""

import contextlib
import json
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from codegen.folder import filehash

FORMAT = "gemma4-qaic-digests/1"
MIN_BYTES = 1 << 24  # hashed in < 25 ms: cheaper to read than to trust a record
MAX_ENTRIES = 4096  # the oldest records go first (a deleted file's record is never used)
# A file modified this recently is not recorded: mtimes come from a coarse clock (a tick of up
# to 10 ms, 1-2 s on some filesystems), so a write later in the same tick keeps the mtime
# (git's "racily clean" entries).
RECENT_NS = 2 * 10**9
_LFS_BLOB = re.compile(r"[0-9a-f]{64}")
CACHE_ENV = "GEMMA4_QAIC_CACHE"
_STORING = threading.Lock()  # export hashes in threads: one rewrite of the file at a time


def cache_root():
    """The project's cache folder: $GEMMA4_QAIC_CACHE, else ~/.cache/gemma4-qaic."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "gemma4-qaic"))


def cache_file():
    """digests.json in `cache_root()`."""
    return os.path.join(cache_root(), "digests.json")


def _load():
    """{"algorithm:dev:ino": [size, mtime_ns, hex digest]} from the cache file; {} when it is
    unreadable."""
    try:
        with open(cache_file()) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _store(key, record):
    """Add one record, rewriting the cache file atomically (temp file + rename); records
    other processes added since `_load` are kept, and a failed write changes nothing."""
    with _STORING:
        _rewrite(key, record)


def _rewrite(key, record):
    """`_store` under its lock."""
    files = _load()
    files.pop(key, None)
    files[key] = record
    while len(files) > MAX_ENTRIES:
        del files[next(iter(files))]
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".digests.", suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "files": files}, f)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _blob_sha256(path, source):
    """The sha256 that names `source`'s HF cache blob, when `path` is that very file."""
    if source is None:
        return None
    blob = os.path.realpath(source)
    name = os.path.basename(blob)
    if os.path.basename(os.path.dirname(blob)) != "blobs" or not _LFS_BLOB.fullmatch(name):
        return None
    try:
        return name if os.path.samefile(path, blob) else None
    except OSError:
        return None


def _local_dir_sha256(path, source):
    """The sha256 `huggingface-cli download --local-dir` recorded for `source`, when `path` is
    that very file and its mtime is at most 1 s after the record (as huggingface_hub checks)."""
    if source is None:
        return None
    source = Path(source)
    meta = source.parent / ".cache" / "huggingface" / "download" / (source.name + ".metadata")
    try:
        with open(meta) as f:
            lines = f.read().splitlines()
        written = float(lines[2])
        fresh = os.stat(path).st_mtime - 1 <= written
        if fresh and _LFS_BLOB.fullmatch(lines[1]) and os.path.samefile(path, source):
            return lines[1]
    except (OSError, ValueError, IndexError):
        return None
    return None


def digest(path, algorithm, *, known=None):
    """Hex digest (`algorithm`: "blake3" or "sha256") of the file `path` (see the module
    docstring for when it is not read). known: the digest a trusted name gave (recorded)."""
    before = os.stat(path)
    if before.st_size < MIN_BYTES:
        return filehash.file_digest(path, algorithm)
    key = f"{algorithm}:{before.st_dev}:{before.st_ino}"
    stamp = [before.st_size, before.st_mtime_ns]
    record = _load().get(key)
    if isinstance(record, list) and len(record) == 3 and record[:2] == stamp:
        if isinstance(record[2], str) and _LFS_BLOB.fullmatch(record[2]):
            return record[2]
    # Recorded under the stat taken before reading: a write during the read changes the mtime,
    # so the record never matches again.
    value = known or filehash.file_digest(path, algorithm)
    if time.time_ns() - before.st_mtime_ns >= RECENT_NS:
        _store(key, [*stamp, value])
    return value


def export_digest(path, *, source=None):
    """(algorithm, hex digest) that export records for the shard `path` hard-linked (or copied)
    from the checkpoint file `source`: its sha256 when an HF blob name or local-dir metadata
    gives it, else its BLAKE3."""
    known = _blob_sha256(path, source) or _local_dir_sha256(path, source)
    if known:
        return "sha256", digest(path, "sha256", known=known)
    return "blake3", digest(path, "blake3")


@contextlib.contextmanager
def threads():
    """A thread pool for digests, one thread a core (hashing and reading release the GIL); on
    leaving, digests not yet started are dropped (a failure does not wait for them)."""
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="digest")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
