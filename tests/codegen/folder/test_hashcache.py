"""codegen.folder.hashcache: a shard is read once per (algorithm, inode, size, mtime), an HF blob
or a fresh local-dir download not at all, and `check_folder` still refuses a shard whose bytes
changed.

Every test points $GEMMA4_QAIC_CACHE at its own tmp folder (never the user's ~/.cache) and
counts the reads through `codegen.folder.filehash.file_digest`. The files are sparse: MIN_BYTES
of hole plus a few written bytes, hashed in milliseconds.
"""

import dataclasses
import hashlib
import json
import os
import time

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.folder import filehash, hashcache
from codegen.folder.integrity import FolderError, check_folder
from codegen.folder.manifest import FORMAT, Manifest, Shard, from_dict

ALGORITHMS = {"sha256": hashlib.sha256, "blake3": blake3.blake3}

SIZE = hashcache.MIN_BYTES + 4096
HOUR_AGO = time.time_ns() - 3600 * 10**9  # older than RECENT_NS: recordable


@pytest.fixture
def reads(tmp_path, monkeypatch):
    """The paths `filehash.file_digest` read, in order (the cache in tmp_path / "cache")."""
    monkeypatch.setenv("GEMMA4_QAIC_CACHE", str(tmp_path / "cache"))
    seen = []
    read = filehash.file_digest

    def counted(path, *a, **k):
        seen.append(str(path))
        return read(path, *a, **k)

    monkeypatch.setattr(filehash, "file_digest", counted)
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


def truth(path, algorithm="sha256"):
    """The digest of the file's bytes as read whole (hashlib, or the blake3 package)."""
    return ALGORITHMS[algorithm](path.read_bytes()).hexdigest()


def sha256(path):
    """What `verify` computes for an older manifest's shard."""
    return hashcache.digest(path, "sha256")


def records():
    with open(hashcache.cache_file()) as f:
        return json.load(f)["files"]


def test_a_file_is_read_once_and_its_hard_links_not_at_all(tmp_path, reads):
    a = sparse(tmp_path / "a")
    assert sha256(a) == truth(a)
    assert sha256(a) == truth(a)
    os.link(a, tmp_path / "b")  # what export does with each shard
    assert sha256(tmp_path / "b") == truth(a)
    assert reads == [str(a)]
    assert hashcache.cache_file() == str(tmp_path / "cache" / "digests.json")


def test_a_rewrite_is_read_again_unless_it_restores_mtime(tmp_path, reads):
    a = sparse(tmp_path / "a")
    old = sha256(a)
    rewrite(a, b"SHARD")  # new content, new mtime: caught
    os.utime(a, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
    assert sha256(a) == truth(a) != old
    assert len(reads) == 2
    # Same size, mtime restored to the nanosecond: the record still matches (the documented
    # blind spot; st_ctime would catch it, but every hard link changes ctime too).
    rewrite(a, b"other")
    os.utime(a, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
    stale = sha256(a)
    assert stale != truth(a) and len(reads) == 2
    os.remove(hashcache.cache_file())  # the cure the docstring names
    assert sha256(a) == truth(a)


def test_a_recent_small_or_changing_file_is_read_and_not_recorded(tmp_path, reads):
    recent = sparse(tmp_path / "recent", mtime_ns=time.time_ns())
    small = sparse(tmp_path / "small", size=hashcache.MIN_BYTES - 1)
    for path in (recent, small, recent, small):
        assert sha256(path) == truth(path)
    assert len(reads) == 4
    assert not os.path.exists(hashcache.cache_file())


def test_a_file_written_while_it_is_read_is_not_recorded(tmp_path, reads, monkeypatch):
    a = sparse(tmp_path / "a")
    read = filehash.file_digest

    def racing(path, algorithm):
        digest = read(path, algorithm)
        rewrite(path, b"SHARD")  # a writer finishing after the read
        os.utime(path, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
        return digest

    monkeypatch.setattr(filehash, "file_digest", racing)
    sha256(a)
    monkeypatch.setattr(filehash, "file_digest", read)
    assert sha256(a) == truth(a)
    assert len(reads) == 2


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])  # sha256: an older export's
def test_check_folder_refuses_a_shard_changed_after_it_was_recorded(tmp_path, reads, algorithm):
    shard = tmp_path / "model.safetensors"
    n = SIZE // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}})
    header = header.encode()
    sparse(shard, 8 + len(header) + 4 * n, len(header).to_bytes(8, "little") + header, at=0)
    recorded = Shard(file=shard.name, bytes=os.path.getsize(shard), copied=False)
    recorded = dataclasses.replace(recorded, **{algorithm: truth(shard, algorithm)})
    manifest = Manifest(
        format=FORMAT, source="", opset=0, options={}, shards=(recorded,), bytes_copied=0, graphs=()
    )
    check_folder(tmp_path, manifest)
    check_folder(tmp_path, manifest)
    assert reads == [str(shard)]
    rewrite(shard, b"\x01", at=os.path.getsize(shard) - 1)  # one weight byte, mtime now
    with pytest.raises(FolderError, match=f"{algorithm} differs from manifest.json's"):
        check_folder(tmp_path, manifest)
    check_folder(tmp_path, manifest, hashes=False)  # sizes and byte ranges only


def test_check_folder_names_the_first_changed_shard_of_those_hashed_in_parallel(tmp_path, reads):
    paths = [sparse(tmp_path / f"model-{i}.safetensors") for i in range(3)]
    shards = tuple(
        Shard(file=p.name, bytes=SIZE, copied=False, blake3=truth(p, "blake3")) for p in paths
    )
    manifest = Manifest(
        format=FORMAT, source="", opset=0, options={}, shards=shards, bytes_copied=0, graphs=()
    )
    for p in paths[1:]:
        rewrite(p, b"SHARD")
    with pytest.raises(FolderError, match="model-1.safetensors: blake3 differs"):
        check_folder(tmp_path, manifest)


def test_an_older_manifests_sha256_is_the_digest_checked():
    shard = {"file": "model.safetensors", "bytes": 8, "copied": False, "sha256": "ab" * 32}
    data = json.loads(
        Manifest(
            format=FORMAT, source="", opset=0, options={}, shards=(), bytes_copied=0, graphs=()
        ).to_json()
    )
    old = from_dict({**data, "shards": [shard]})
    assert old.shards[0].digest == ("sha256", "ab" * 32) and old.shards[0].blake3 is None
    assert from_dict({**data, "shards": [{**shard, "sha256": None}]}).shards[0].digest is None


@settings(max_examples=12, deadline=None)
@given(
    spans=st.lists(st.tuples(st.booleans(), st.integers(1, 3 * 4096)), min_size=1, max_size=5),
    block=st.sampled_from([1, 4096, 5000, filehash.BLOCK]),
    algorithm=st.sampled_from(sorted(ALGORITHMS)),
)
def test_a_files_digest_is_that_of_its_bytes_read_whole(tmp_path_factory, spans, block, algorithm):
    path = tmp_path_factory.mktemp("digest") / "f"
    with open(path, "wb") as f:
        for is_data, length in spans:  # a hole where not data: seek past it
            if is_data:
                f.write(os.urandom(length))
            else:
                f.seek(length, os.SEEK_CUR)
        f.truncate(f.tell())
    assert filehash.file_digest(path, algorithm, block) == truth(path, algorithm)


def test_a_hole_is_found_and_not_read(tmp_path):
    path = sparse(tmp_path / "a", size=4 << 20, data=b"x" * 4096, at=1 << 20)
    fd = os.open(path, os.O_RDONLY)
    try:
        spans = filehash.extents(fd, 4 << 20)
    finally:
        os.close(fd)
    tail = (4 << 20) - (1 << 20) - 4096
    assert spans == [(0, 1 << 20, False), (1 << 20, 4096, True), ((1 << 20) + 4096, tail, False)]


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
    assert hashcache.export_digest(out / "lfs", source=repo / "snapshots/rev/abababab") == (
        "sha256",
        claimed,
    )
    assert sha256(out / "lfs") == claimed  # verify: from the record export made
    assert reads == []
    os.link(repo / "blobs" / ("cd" * 20), out / "git")
    git = hashcache.export_digest(out / "git", source=repo / "snapshots/rev/cdcdcdcd")
    assert git == ("blake3", truth(out / "git", "blake3"))
    copy = sparse(out / "copy")  # not the blob's inode (a copy): read
    copied = hashcache.export_digest(copy, source=repo / "snapshots/rev/abababab")
    assert copied == ("blake3", truth(copy, "blake3"))
    assert reads == [str(out / "git"), str(copy)]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        '{"format": "other", "files": {}}',
        '{"format": "gemma4-qaic-digests/1", "files": []}',
        '{"format": "gemma4-qaic-digests/1", "files": {"KEY": [1, 2]}}',
        '{"format": "gemma4-qaic-digests/1", "files": {"KEY": ["SIZE", "MTIME", 7]}}',
        '{"format": "gemma4-qaic-digests/1", "files": {"KEY": ["SIZE", "MTIME", "not hex"]}}',
    ],
)
def test_a_malformed_cache_counts_as_empty_and_is_rewritten(tmp_path, reads, content):
    a = sparse(tmp_path / "a")
    st = os.stat(a)
    os.makedirs(os.path.dirname(hashcache.cache_file()))
    with open(hashcache.cache_file(), "w") as f:
        f.write(
            content.replace('"KEY"', f'"sha256:{st.st_dev}:{st.st_ino}"')
            .replace('"SIZE"', str(st.st_size))
            .replace('"MTIME"', str(st.st_mtime_ns))
        )
    assert sha256(a) == truth(a)
    assert records() == {f"sha256:{st.st_dev}:{st.st_ino}": [st.st_size, st.st_mtime_ns, truth(a)]}


@pytest.mark.parametrize("blocked", ["root is a file", "digests.json is a folder"])
def test_an_unwritable_cache_is_not_fatal(tmp_path, reads, monkeypatch, blocked):
    root = tmp_path / "root"
    if blocked == "root is a file":
        root.write_text("")
    else:
        (root / "digests.json").mkdir(parents=True)
    monkeypatch.setenv("GEMMA4_QAIC_CACHE", str(root))
    a = sparse(tmp_path / "a")
    assert sha256(a) == sha256(a) == truth(a)
    assert len(reads) == 2
    if root.is_dir():
        assert os.listdir(root) == ["digests.json"]  # no temp file left behind


def test_the_cache_keeps_the_newest_records(tmp_path, reads, monkeypatch):
    monkeypatch.setattr(hashcache, "MAX_ENTRIES", 2)
    a, b, c = (sparse(tmp_path / name) for name in "abc")
    sha256(a)
    sha256(b)
    rewrite(a, b"SHARD")
    os.utime(a, ns=(HOUR_AGO + 1, HOUR_AGO + 1))
    sha256(a)  # recorded again: now newer than b's record
    sha256(c)
    keys = (f"sha256:{os.stat(p).st_dev}:{os.stat(p).st_ino}" for p in (a, c))
    assert sorted(records()) == sorted(keys)


def local_dir(tmp_path, etag, written_s):
    """A `huggingface-cli download --local-dir` folder: one shard and the metadata
    huggingface_hub writes for it (commit, etag, the time it was written)."""
    shard = sparse(tmp_path / "model.safetensors")
    meta = tmp_path / ".cache" / "huggingface" / "download" / "model.safetensors.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{'0' * 40}\n{etag}\n{written_s}\n")
    out = tmp_path / "out"
    out.mkdir()
    os.link(shard, out / "model.safetensors")  # as export.place_shards links
    return shard, out / "model.safetensors"


def test_local_dir_metadata_gives_the_sha256_when_the_file_is_not_newer(tmp_path, reads):
    claimed = "ef" * 32  # not the content's hash: the test sees the etag was trusted
    shard, linked = local_dir(tmp_path, claimed, HOUR_AGO / 1e9 - 0.5)  # mtime within 1 s
    assert hashcache.export_digest(linked, source=shard) == ("sha256", claimed)
    assert sha256(linked) == claimed  # verify: from the record export made
    assert reads == []


@pytest.mark.parametrize(
    "etag, written_s, linked",
    [
        ("ef" * 32, HOUR_AGO / 1e9 - 2, True),  # the file was written after the metadata
        ("ef" * 20, HOUR_AGO / 1e9, True),  # a git file's sha1 etag
        ("ef" * 32, "not a time", True),
        ("ef" * 32, HOUR_AGO / 1e9, False),  # the shard in the folder is a copy
    ],
    ids=["file newer", "sha1 etag", "malformed time", "a copy"],  # the times differ per worker
)
def test_local_dir_metadata_is_ignored_unless_it_matches(tmp_path, reads, etag, written_s, linked):
    shard, placed = local_dir(tmp_path, etag, written_s)
    if not linked:
        os.remove(placed)
        sparse(placed)
    assert hashcache.export_digest(placed, source=shard) == ("blake3", truth(placed, "blake3"))
    assert reads == [str(placed)]
