"""Hugging Face model folders: config.json plus model.safetensors, or shards with an index.

Accepted layouts (checked in this order, as transformers does):
  model.safetensors                       one file holding every tensor
  model.safetensors.index.json + shards   {"weight_map": {tensor: shard file}}
Shard names in the index must stay inside the folder by their spelling (no `..`, not
absolute); the shard files themselves may be symbolic links anywhere (the HF cache keeps
`snapshots/<rev>/x.safetensors -> ../../blobs/<hash>`).
"""

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from weights.blocks import LazyTensor
from weights.errors import CheckpointError
from weights.safetensors import (
    MAX_HEADER_BYTES,
    TensorInfo,
    open_regular,
    parse_json,
    read_header,
    read_tensor,
)
from weights.writer import atomic_write, write_safetensors

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Checkpoint:
    """An opened, validated model folder; tensors are read only when asked for."""

    dir: Path
    config: dict
    tensors: dict[str, TensorInfo]
    shards: list[Path]

    def read(self, name: str, *, mapped: bool = True, out=None, stage=None) -> np.ndarray:
        """One tensor by its checkpoint name, memory-mapped (or read into memory: `mapped`
        False, into `out` when given, cast through `stage` when given; see `read_tensor`)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.dir}: no tensor {name!r} in the checkpoint")
        return read_tensor(self.tensors[name], mapped=mapped, out=out, stage=stage)

    def tree(self, prefix: str = "", *, lazy: bool = False) -> dict:
        """Nested dict of arrays keyed by the names split on "."; `prefix` selects and strips.

        `tree("model.vision_tower")` is the vision tower alone, keyed from "encoder", ...
        lazy: leaves are `LazyTensor`s (nothing read until a block is asked for) instead of
        memory-mapped arrays.
        """
        if prefix and not prefix.endswith("."):
            prefix += "."
        names = [n for n in self.tensors if n.startswith(prefix)]
        if not names:
            what = f"no tensor names start with {prefix!r}" if prefix else "holds no tensors"
            raise CheckpointError(f"{self.dir}: {what}")
        tree: dict = {}
        for name in names:
            *path, leaf = name[len(prefix) :].split(".")
            node = tree
            for i, key in enumerate(path):
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    clash = prefix + ".".join(path[: i + 1])
                    raise CheckpointError(
                        f"{self.dir}: tensor {name!r} nests under tensor {clash!r}; "
                        "a name cannot be both a tensor and a group"
                    )
            if leaf in node:
                raise CheckpointError(
                    f"{self.dir}: tensor {name!r} is also the group of other tensors; "
                    "a name cannot be both a tensor and a group"
                )
            node[leaf] = LazyTensor(self.tensors[name]) if lazy else self.read(name)
        return tree

    def require(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raise if any expected tensor is missing or has another shape (names both shapes)."""
        check_shapes({n: i.shape for n, i in self.tensors.items()}, expected, str(self.dir))


def check_shapes(found: dict, expected: dict, where: str) -> None:
    """Raise CheckpointError unless every expected tensor is in `found` ({name: shape}) with
    its expected shape; the message names the tensor, both shapes and `where`."""
    for name, shape in expected.items():
        got = found.get(name)
        if got is None:
            raise CheckpointError(
                f"{where}: tensor {name!r} with shape {tuple(shape)} is missing "
                f"(found shape: none; the checkpoint holds {len(found)} tensors)"
            )
        if tuple(got) != tuple(shape):
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(got)}, expected {tuple(shape)}"
            )


def _read_json_object(path: Path, what: str, *, strict: bool) -> dict:
    with open_regular(path) as f:
        raw = f.read(MAX_HEADER_BYTES + 1)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: {what} is larger than {MAX_HEADER_BYTES} bytes")
    value = parse_json(path, raw, what, strict=strict)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def _shard_path(model_dir: Path, index: Path, tensor: str, name) -> Path:
    """The folder path an index entry names, refusing names that leave the folder."""
    parts = PurePosixPath(name).parts if isinstance(name, str) else ()
    if (
        not parts
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or ".." in parts
        or ":" in parts[0]
    ):
        raise CheckpointError(
            f"{index}: tensor {tensor!r} maps to shard {name!r:.200}; expected a relative file "
            "name inside the model folder (no '..', not absolute)"
        )
    return model_dir.joinpath(*(p for p in parts if p != "."))


def _open_sharded(model_dir: Path, index_path: Path) -> tuple[dict[str, TensorInfo], list[Path]]:
    index = _read_json_object(index_path, "shard index", strict=True)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index_path}: 'weight_map' must be a non-empty object mapping tensor names to "
            f"shard files, got {weight_map!r:.200}"
        )
    wanted = {t: _shard_path(model_dir, index_path, t, f) for t, f in weight_map.items()}
    found: dict[str, TensorInfo] = {}
    shards = sorted(set(wanted.values()))
    for shard in shards:
        if not os.path.exists(shard):
            tensor = next(t for t, s in wanted.items() if s == shard)
            kind = "a broken symbolic link" if os.path.islink(shard) else "missing"
            raise CheckpointError(
                f"{index_path}: shard {shard} (holding tensor {tensor!r}) is {kind}"
            )
        for name, info in read_header(shard).items():
            if name in found:
                raise CheckpointError(
                    f"{shard}: tensor {name!r} is also in shard {found[name].file}; "
                    "a tensor must live in exactly one shard"
                )
            found[name] = info
    for name, shard in wanted.items():
        info = found.get(name)
        if info is None or info.file != shard:
            raise CheckpointError(
                f"{index_path}: lists tensor {name!r} in shard {shard.name}, which does not "
                "hold it" + (f" (it is in {info.file.name})" if info else "")
            )
    for name, info in found.items():
        if name not in wanted:
            raise CheckpointError(
                f"{info.file}: holds tensor {name!r}, which the shard index {INDEX} does not list"
            )
    return found, shards


def open_checkpoint(model_dir) -> Checkpoint:
    """Open and validate an HF model folder (headers only; no tensor data is read)."""
    model_dir = Path(os.path.abspath(model_dir))
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a folder")
    config = _read_json_object(model_dir / CONFIG, "config", strict=False)
    single, index = model_dir / SINGLE, model_dir / INDEX
    if os.path.lexists(single):
        found, shards = read_header(single), [single]
    elif os.path.lexists(index):
        found, shards = _open_sharded(model_dir, index)
    else:
        raise CheckpointError(f"{model_dir}: has neither {SINGLE} nor {INDEX}")
    tensors = {name: found[name] for name in sorted(found)}
    return Checkpoint(dir=model_dir, config=config, tensors=tensors, shards=shards)


def generation_config(model_dir) -> dict | None:
    """The folder's generation_config.json as a dict (stop ids, pad id, sampling defaults), or
    None when the folder has none."""
    path = Path(os.path.abspath(model_dir)) / GENERATION_CONFIG
    if not os.path.lexists(path):
        return None
    return _read_json_object(path, "generation config", strict=False)


def load_checkpoint(model_dir, *, lazy: bool = False) -> tuple[dict, dict]:
    """-> (config dict, nested parameter tree keyed by the checkpoint's names split on ".").

    lazy: leaves are `LazyTensor`s whose blocks are read from their byte ranges on demand
    (what a device mesh loads slice by slice) instead of memory-mapped arrays.
    """
    checkpoint = open_checkpoint(model_dir)
    return checkpoint.config, checkpoint.tree(lazy=lazy)


def plan_shards(nbytes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, as save_pretrained splits them: greedy in name order, a shard
    closes when the next tensor would overflow it. nbytes: {name: byte size}."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(nbytes):
        if shards[-1] and size + nbytes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def _write_folder(folder: Path, config: dict, tensors: dict, max_shard_bytes) -> None:
    atomic_write(folder / CONFIG, [json.dumps(config, indent=2).encode("utf-8")])
    meta = {"format": "pt"}  # transformers' loader expects it
    sizes = {n: np.asarray(t).nbytes for n, t in tensors.items()}
    plan = plan_shards(sizes, max_shard_bytes) if max_shard_bytes else [sorted(tensors)]
    if len(plan) == 1:
        write_safetensors(folder / SINGLE, tensors, meta)
        return
    weight_map = {}
    for i, names in enumerate(plan):
        shard = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        write_safetensors(folder / shard, {n: tensors[n] for n in names}, meta)
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(np.asarray(a).nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(folder / INDEX, [json.dumps(index, indent=2).encode("utf-8")])


def save_checkpoint(
    model_dir,
    config: dict,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
) -> None:
    """Write an HF model folder atomically: built in a temporary sibling, then renamed.

    With `max_shard_bytes`, tensors (in name order) go to model-0000i-of-0000n.safetensors
    shards plus model.safetensors.index.json, as `save_pretrained(max_shard_size=...)` does;
    a plan that needs one shard writes model.safetensors. An existing non-empty folder is
    replaced only with `overwrite=True`.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    if max_shard_bytes is not None and not (
        isinstance(max_shard_bytes, int) and max_shard_bytes > 0
    ):
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    target = Path(os.path.abspath(model_dir))
    if os.path.lexists(target) and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a folder")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise FileExistsError(f"{target} is not empty; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        _write_folder(tmp, config, tensors, max_shard_bytes)
        os.chmod(tmp, 0o755)
        if target.is_dir() and any(target.iterdir()):
            old = Path(
                tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".old")
            )
            os.replace(target, old / "replaced")
            os.replace(tmp, target)
            shutil.rmtree(old)
        else:
            os.replace(tmp, target)  # replaces an empty folder too
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
