"""Writing safetensors files (the reference writer's layout) and any file atomically: a
temporary sibling, fsync, then a rename, so no half-written file is ever left."""

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from weights.safetensors import MAX_HEADER_BYTES, _valid_text, dtype_code


def _check_tensors(tensors: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, array in tensors.items():
        if not _valid_text(name) or name == "__metadata__":
            raise ValueError(
                f"tensor name {name!r} must be a Unicode string other than __metadata__"
            )
        if not isinstance(array, np.ndarray | np.generic):
            raise TypeError(f"tensor {name!r} must be a numpy array, got {type(array).__name__}")
        dtype_code(array.dtype)
        out[name] = np.asarray(array, array.dtype.newbyteorder("<"), order="C")
    return out


def atomic_write(path: Path, chunks) -> None:
    """Write `chunks` (bytes-like) to a temporary sibling, fsync, then rename over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_safetensors(path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (name -> numpy array, bf16/fp8 via ml_dtypes) as one safetensors file.

    Like the reference writer, data is ordered by descending element size then name and
    the header is space-padded to 8 bytes, so every tensor starts aligned to its element.
    """
    path = Path(path)
    arrays = _check_tensors(tensors)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(_valid_text(k) and _valid_text(v) for k, v in metadata.items())
    ):
        raise TypeError(f"metadata must map str to str, got {metadata!r:.200}")
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict = {} if metadata is None else {"__metadata__": dict(metadata)}
    begin = 0
    for name in order:
        a = arrays[name]
        header[name] = {
            "dtype": dtype_code(a.dtype),
            "shape": list(a.shape),
            "data_offsets": [begin, begin + a.nbytes],
        }
        begin += a.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header of {len(raw)} bytes exceeds the format's limit")
    chunks = [len(raw).to_bytes(8, "little"), raw]
    chunks += [arrays[name].reshape(-1).view(np.uint8) for name in order]
    atomic_write(path, chunks)
