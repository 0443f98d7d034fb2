"""A shard's sha256 without reading the shard again.

`export` records each shard's sha256 in manifest.json and `verify`/`run` check it
(`codegen.folder.integrity`); reading a 31B checkpoint (58 GiB) takes 60-75 s at 0.8-1 GB/s. Two
shortcuts make that nearly free, and any other file is read:
- A Hugging Face cache blob (`models--org--name/blobs/<64 hex>`, the snapshot's file a symlink
  to it) is an LFS file named by the sha256 of its content (git blobs have 40-hex sha1 names
  and are read). Export hard-links the blob, so its hash is known before a byte is read.
- `sha256.json` in the project's cache folder ($GEMMA4_QAIC_CACHE, else ~/.cache/gemma4-qaic,
  where the default model also lives) maps a file's identity (st_dev, st_ino) to the
  (st_size, st_mtime_ns, sha256) it had when hashed; a file whose size and mtime still match
  is not read. The export folder's shards are hard links of the checkpoint's (one inode), so
  `verify` and `run` after an export, and the next export of that checkpoint, read nothing.

The key leaves st_ctime out on purpose: making or removing a hard link changes it, and every
export links the shards (and `--force` then unlinks the previous export's), so a ctime key
would re-read the whole checkpoint after each export. The price: a same-size in-place rewrite
that restores mtime to the nanosecond (`os.utime`, `touch -d`, `cp -p` from a file with the
same mtime) keeps the old hash; delete sha256.json to have every shard read again. DVC's state
database, whose workspace files are often hard links into its cache, checks the same (inode,
mtime, size) (dvc/state.py `_file_metadata_changed`). A blob's name is trusted only at export:
`verify` checks the record made then, which an edit of the blob (new mtime) no longer matches.
Files under MIN_BYTES are always read (milliseconds), and a file modified in the last
RECENT_NS is read and not recorded. The cache is an optimization: an unreadable or malformed
sha256.json counts as empty, and one that cannot be written is left as it is.
"""

import contextlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

from codegen.folder import external

FORMAT = "gemma4-qaic-sha256/1"
MIN_BYTES = 1 << 24  # hashed in < 25 ms: cheaper to read than to trust a record
MAX_ENTRIES = 4096  # the oldest records go first (a deleted file's record is never used)
# A file modified this recently is not recorded: mtimes come from a coarse clock (a tick of up
# to 10 ms, 1-2 s on some filesystems), so a write later in the same tick keeps the mtime
# (git's "racily clean" entries).
RECENT_NS = 2 * 10**9
_LFS_BLOB = re.compile(r"[0-9a-f]{64}")
CACHE_ENV = "GEMMA4_QAIC_CACHE"


def cache_root():
    """The project's cache folder: $GEMMA4_QAIC_CACHE, else ~/.cache/gemma4-qaic."""
    return Path(os.environ.get(CACHE_ENV) or os.path.join(Path.home(), ".cache", "gemma4-qaic"))


def cache_file():
    """sha256.json in `cache_root()`."""
    return os.path.join(cache_root(), "sha256.json")


def _load():
    """{"dev:ino": [size, mtime_ns, sha256]} from the cache file; {} when it is unreadable."""
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
    files = _load()
    files.pop(key, None)
    files[key] = record
    while len(files) > MAX_ENTRIES:
        del files[next(iter(files))]
    path = cache_file()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".sha256.", suffix=".tmp")
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


def sha256(path, *, source=None):
    """Hex sha256 of the file `path` (see the module docstring for when it is not read).
    `source`: the checkpoint path `path` was hard-linked from (its HF blob name is used)."""
    before = os.stat(path)
    if before.st_size < MIN_BYTES:
        return external.sha256(path)
    key, stamp = f"{before.st_dev}:{before.st_ino}", [before.st_size, before.st_mtime_ns]
    record = _load().get(key)
    if isinstance(record, list) and len(record) == 3 and record[:2] == stamp:
        if isinstance(record[2], str) and _LFS_BLOB.fullmatch(record[2]):
            return record[2]
    # Recorded under the stat taken before reading: a write during the read changes the mtime,
    # so the record never matches again.
    digest = _blob_sha256(path, source) or external.sha256(path)
    if time.time_ns() - before.st_mtime_ns >= RECENT_NS:
        _store(key, [*stamp, digest])
    return digest
