"""An export folder is checked before `verify` or `run` computes with it.

The graphs read their weights at byte ranges of the hard-linked shards, so a shard edited,
truncated or replaced after export would make every answer use other weights without a word.
`check_folder` refuses such a folder, naming the file: each shard the manifest lists must exist
with its recorded size and digest (BLAKE3, or sha256: an HF blob's, or an older export's), and
every external initializer of every graph must point at exactly the bytes the shard's own header
gives that tensor (weight specs of `--weights inputs` graphs must name tensors the shards hold).
A shard whose size and mtime are those it had when last hashed is not read again
(`codegen.folder.hashcache`).
"""

import json
import os

import onnx
from google.protobuf.message import DecodeError

from codegen.folder import hashcache, paired
from weights import CheckpointError, read_header


class FolderError(ValueError):
    """The export folder does not match its manifest."""


def _check_shard(folder, shard):
    path = os.path.join(folder, shard.file)
    if not os.path.isfile(path):
        raise FolderError(f"{path}: missing (manifest.json lists it)")
    size = os.path.getsize(path)
    if size != shard.bytes:
        raise FolderError(f"{path}: {size} bytes, manifest.json records {shard.bytes}")


def _check_digests(folder, shards):
    """FolderError naming the first of `shards` (in manifest order) whose digest is not the one
    manifest.json records; the shards are hashed in parallel (`hashcache.threads`)."""
    recorded = [(os.path.join(folder, s.file), *s.digest) for s in shards if s.digest]
    with hashcache.threads() as pool:
        found = [pool.submit(hashcache.digest, path, algorithm) for path, algorithm, _ in recorded]
        for (path, algorithm, value), digest in zip(recorded, found, strict=True):
            if digest.result() != value:
                raise FolderError(
                    f"{path}: {algorithm} differs from manifest.json's (the shard changed after "
                    "export)"
                )


def _external_entries(model):
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            yield t.name, {e.key: e.value for e in t.external_data}


def _check_graph(folder, entry, headers):
    path = os.path.join(folder, entry.file)
    try:
        model = onnx.load(path, load_external_data=False)
    except (OSError, ValueError, DecodeError) as e:
        raise FolderError(f"{path}: not a readable ONNX model ({e})") from e
    for name, ext in _external_entries(model):
        location = ext.get("location", "")
        held = headers.get(location, {}).get(paired.stored_name(location, name))
        where = (int(ext.get("offset", 0)), int(ext.get("length", -1)))
        if held is None or where != (held.offset, held.nbytes):
            found = "no such tensor" if held is None else f"bytes {held.offset}+{held.nbytes}"
            raise FolderError(
                f"{path}: weight {name!r} points at bytes {where[0]}+{where[1]} of "
                f"{ext.get('location')!r}, whose header gives {found}"
            )
    if entry.weight_spec:
        with open(os.path.join(folder, entry.weight_spec)) as f:
            spec = json.load(f)
        for item in spec["inputs"]:
            loc = item["location"]
            if item["name"] not in headers.get(loc["file"], {}):
                raise FolderError(
                    f"{os.path.join(folder, entry.weight_spec)}: weight {item['name']!r} "
                    f"is not in {loc['file']!r}"
                )


def check_folder(folder, manifest, *, hashes=True):
    """Raise FolderError unless the folder's shards and graphs match `manifest` (a
    `codegen.folder.manifest.Manifest`; see above). hashes=False skips the digests (sizes and byte
    ranges are still checked)."""
    for shard in manifest.shards:
        _check_shard(folder, shard)
    if hashes:
        _check_digests(folder, manifest.shards)
    headers = {}
    for shard in manifest.shards:
        try:
            headers[shard.file] = read_header(os.path.join(folder, shard.file))
        except CheckpointError as e:
            raise FolderError(str(e)) from e
    for entry in manifest.graphs:
        _check_graph(folder, entry, headers)
