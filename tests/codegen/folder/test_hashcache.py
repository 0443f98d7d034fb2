"""codegen.folder.hashcache: a shard is read once per (inode, size, mtime), an HF blob not at all,
and `check_folder` still refuses a shard whose bytes changed.

Every test points $GEMMA4_QAIC_CACHE at its own tmp folder (never the user's ~/.cache) and
counts the reads through `codegen.folder.external.sha256`. The files are sparse: MIN_BYTES of hole
plus a few written bytes, hashed in tens of milliseconds.
"""

import hashlib
import json
import os
import time

import pytest

from codegen.folder import external, hashcache
from codegen.folder.integrity import FolderError, check_folder
from codegen.folder.manifest import FORMAT, Manifest, Shard

SIZE = hashcache.MIN_BYTES + 4096
HOUR_AGO = time.time_ns() - 3600 * 10**9  # older than RECENT_NS: recordable


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """The paths `external.sha256` read, in order (the cache in tmp_path / "cache")."""
    monkeypatch.setenv("GEMMA4_QAIC_CACHE", str(tmp_path / "cache"))
    seen = []
    read = external.sha256

    def counted(path, *a, **k):
        seen.append(str(path))
        return read(path, *a, **k)

    monkeypatch.setattr(external, "sha256", counted)
    return seen


def sparse(path, size=SIZE, data=b"shard", at=1000, mtime_ns=HOUR_AGO):
    """A file of `size` bytes, a hole but `data` at offset `at`, modified at `mtime_ns`."""
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(at)
        f.write(data)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return path


def rewrite(path, data, at=1000):
    """Overwrite bytes in place (same inode, same size); the kernel sets a new mtime."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def truth(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def records():
    with open(hashcache.cache_file()) as f:
        return json.load(f)["files"]


def test_a_file_is_read_once_and_its_hard_links_not_at_all(tmp_path, reads):
    a = sparse(tmp_path / "a")
    assert hashcache.sha256(a) == truth(a)
    assert hashcache.sha256(a) == truth(a)
    os.link(a, tmp_path / "b")  # what export does with each shard
    assert hashcache.sha256(tmp_path / "b") == truth(a)
    assert reads == [str(a)]
    assert hashcache.cache_file() == str(tmp_path / "cache" / "sha256.json")


def test_a_rewrite_is_read_again_unless_it_restores_mtime(tmp_path, reads):
    a = sparse(tmp_path / "a")
    old = hashcache.sha256(a)
    rewrite(a, b"SHARD")  # new content, new mtime: caught
    os.utime(a, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
    assert hashcache.sha256(a) == truth(a) != old
    assert len(reads) == 2
    # Same size, mtime restored to the nanosecond: the record still matches (the documented
    # blind spot; st_ctime would catch it, but every hard link changes ctime too).
    rewrite(a, b"other")
    os.utime(a, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
    stale = hashcache.sha256(a)
    assert stale != truth(a) and len(reads) == 2
    os.remove(hashcache.cache_file())  # the cure the docstring names
    assert hashcache.sha256(a) == truth(a)


def test_a_recent_small_or_changing_file_is_read_and_not_recorded(tmp_path, reads):
    recent = sparse(tmp_path / "recent", mtime_ns=time.time_ns())
    small = sparse(tmp_path / "small", size=hashcache.MIN_BYTES - 1)
    for path in (recent, small, recent, small):
        assert hashcache.sha256(path) == truth(path)
    assert len(reads) == 4
    assert not os.path.exists(hashcache.cache_file())


def test_a_file_written_while_it_is_read_is_not_recorded(tmp_path, reads, monkeypatch):
    a = sparse(tmp_path / "a")
    read = external.sha256

    def racing(path):
        digest = read(path)
        rewrite(path, b"SHARD")  # a writer finishing after the read
        os.utime(path, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
        return digest

    monkeypatch.setattr(external, "sha256", racing)
    hashcache.sha256(a)
    monkeypatch.setattr(external, "sha256", read)
    assert hashcache.sha256(a) == truth(a)
    assert len(reads) == 2


def test_check_folder_refuses_a_shard_changed_after_it_was_recorded(tmp_path, reads):
    shard = tmp_path / "model.safetensors"
    n = SIZE // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    header = header.encode()
    sparse(shard, 8 + len(header) + 4 * n, len(header).to_bytes(8, "little") + header, at=0)
    recorded = Shard(
        file=shard.name, bytes=os.path.getsize(shard), copied=False, sha256=truth(shard)
    )
    manifest = Manifest(
        format=FORMAT, source="", opset=0, options={}, shards=(recorded,), bytes_copied=0, graphs=()
    )
    check_folder(tmp_path, manifest)
    check_folder(tmp_path, manifest)
    assert reads == [str(shard)]
    rewrite(shard, b"\x01", at=os.path.getsize(shard) - 1)  # one weight byte, mtime now
    with pytest.raises(FolderError, match="sha256 differs from manifest.json's"):
        check_folder(tmp_path, manifest)
    check_folder(tmp_path, manifest, hashes=False)  # sizes and byte ranges only


def test_an_hf_blob_name_is_its_hash_but_a_sha1_name_is_not(tmp_path, reads):
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "rev").mkdir(parents=True)
    claimed = "ab" * 32  # not the content's hash: the test sees the name was trusted
    for name in (claimed, "cd" * 20):
        sparse(repo / "blobs" / name)
        (repo / "snapshots" / "rev" / name[:8]).symlink_to(f"../../blobs/{name}")
    out = tmp_path / "out"
    out.mkdir()
    os.link(repo / "blobs" / claimed, out / "lfs")  # as export.place_shards links
    assert hashcache.sha256(out / "lfs", source=repo / "snapshots/rev/abababab") == claimed
    assert hashcache.sha256(out / "lfs") == claimed  # verify: from the record export made
    assert reads == []
    os.link(repo / "blobs" / ("cd" * 20), out / "git")
    assert hashcache.sha256(out / "git", source=repo / "snapshots/rev/cdcdcdcd") == truth(
        out / "git"
    )
    copy = sparse(out / "copy")  # not the blob's inode (a copy): read
    assert hashcache.sha256(copy, source=repo / "snapshots/rev/abababab") == truth(copy)
    assert reads == [str(out / "git"), str(copy)]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"format": "other", "files": {}}',
        '{"format": "gemma4-qaic-sha256/1", "files": []}',
        '{"format": "gemma4-qaic-sha256/1", "files": {"KEY": [1, 2]}}',
        '{"format": "gemma4-qaic-sha256/1", "files": {"KEY": ["SIZE", "MTIME", 7]}}',
        '{"format": "gemma4-qaic-sha256/1", "files": {"KEY": ["SIZE", "MTIME", "not hex"]}}',
    ],
)
def test_a_malformed_cache_counts_as_empty_and_is_rewritten(tmp_path, reads, content):
    a = sparse(tmp_path / "a")
    st = os.stat(a)
    os.makedirs(os.path.dirname(hashcache.cache_file()))
    with open(hashcache.cache_file(), "w") as f:
        f.write(
            content.replace('"KEY"', f'"{st.st_dev}:{st.st_ino}"')
            .replace('"SIZE"', str(st.st_size))
            .replace('"MTIME"', str(st.st_mtime_ns))
        )
    assert hashcache.sha256(a) == truth(a)
    assert records() == {f"{st.st_dev}:{st.st_ino}": [st.st_size, st.st_mtime_ns, truth(a)]}


@pytest.mark.parametrize("blocked", ["root is a file", "sha256.json is a folder"])
def test_an_unwritable_cache_is_not_fatal(tmp_path, reads, monkeypatch, blocked):
    root = tmp_path / "root"
    if blocked == "root is a file":
        root.write_text("")
    else:
        (root / "sha256.json").mkdir(parents=True)
    monkeypatch.setenv("GEMMA4_QAIC_CACHE", str(root))
    a = sparse(tmp_path / "a")
    assert hashcache.sha256(a) == hashcache.sha256(a) == truth(a)
    assert len(reads) == 2
    if root.is_dir():
        assert os.listdir(root) == ["sha256.json"]  # no temp file left behind


def test_the_cache_keeps_the_newest_records(tmp_path, reads, monkeypatch):
    monkeypatch.setattr(hashcache, "MAX_ENTRIES", 2)
    a, b, c = (sparse(tmp_path / name) for name in "abc")
    hashcache.sha256(a)
    hashcache.sha256(b)
    rewrite(a, b"SHARD")
    os.utime(a, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
    hashcache.sha256(a)  # recorded again: now newer than b's record
    hashcache.sha256(c)
    assert sorted(records()) == sorted(f"{os.stat(p).st_dev}:{os.stat(p).st_ino}" for p in (a, c))
