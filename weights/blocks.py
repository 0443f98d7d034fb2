"""Blocks of tensors read from their byte ranges alone: what one device of a mesh needs.

A block is a box `[a_0, b_0) × [a_1, b_1) × …` of a row-major tensor. The trailing dims it
takes whole, plus the last dim it cuts, form one contiguous run of bytes per index of the dims
before; only those runs are read (`os.preadv` into the result), so a host never holds more
of a tensor than the block. Runs shorter than a page cost a page of I/O each anyway: those are
read in spans of whole rows of at most `SPAN` bytes and picked out, one call per span instead
of one per run.
"""

import math
from dataclasses import dataclass

import numpy as np

from weights.safetensors import TensorInfo, _readable, open_regular, pread_into, read_tensor

PAGE = 4096
SPAN = 1 << 23  # bytes per read of short runs: bounds the scratch buffer


def block_bounds(shape: tuple[int, ...], index) -> list[tuple[int, int]]:
    """[(start, stop)] per dim of `shape` for `index`, a tuple of step-1 slices (one per
    leading dim; missing dims are whole), as `jax.make_array_from_callback` passes them."""
    index = tuple(index) if isinstance(index, tuple) else (index,)
    if len(index) > len(shape):
        raise IndexError(f"index {index} has {len(index)} entries for a {len(shape)}-d tensor")
    bounds = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise IndexError(f"index {index}: entry {i} is {s!r}; expected a slice with step 1")
        start, stop, _ = s.indices(n)
        bounds.append((start, max(start, stop)))
    return bounds


def _runs(shape, bounds):
    """(first element of each contiguous run [R], elements per run) of a block."""
    partial = [i for i, ((a, b), n) in enumerate(zip(bounds, shape, strict=True)) if b - a != n]
    split = partial[-1] if partial else 0
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]  # elements, row-major
    base = sum(a * st for (a, _), st in zip(bounds, strides, strict=True))
    starts = np.full(1, base, np.int64)
    for (a, b), st in zip(bounds[:split], strides[:split], strict=True):
        starts = (starts[:, None] + np.arange(b - a) * st).reshape(-1)
    return starts, math.prod(b - a for a, b in bounds[split:])


def read_block(info: TensorInfo, index) -> np.ndarray:
    """The block `tensor[index]` of the tensor `info` locates, read from its bytes alone.

    index: a tuple of step-1 slices (see `block_bounds`) → a new writable array of the block's
    shape, bit-exact.
    """
    dt = _readable(info)
    bounds = block_bounds(info.shape, index)
    out = np.empty(tuple(b - a for a, b in bounds), dt)
    if out.size == 0:
        return out
    starts, run = _runs(info.shape, bounds)
    size = dt.itemsize
    flat = out.reshape(-1).view(np.uint8)
    nbytes = run * size
    with open_regular(info.file) as f:
        if nbytes >= PAGE or len(starts) == 1:
            for j, start in enumerate(starts.tolist()):
                pread_into(f, info, flat[j * nbytes : (j + 1) * nbytes], info.offset + start * size)
            return out
        pick = np.arange(nbytes)
        j, reach = 0, max(run, SPAN // size) - run  # elements a span reaches past its start
        while j < len(starts):
            end = max(j + 1, int(np.searchsorted(starts, starts[j] + reach, side="right")))
            group = starts[j:end] - starts[j]
            span = np.empty((int(group[-1]) + run) * size, np.uint8)
            pread_into(f, info, span, info.offset + int(starts[j]) * size)
            flat[j * nbytes : end * nbytes] = span[group[:, None] * size + pick].reshape(-1)
            j = end
    return out


@dataclass(frozen=True)
class LazyTensor:
    """A checkpoint tensor not yet read: `shape`, `dtype`, and `tensor[index]` reads one block
    (`read_block`); `np.asarray(tensor)` maps the whole (`read_tensor`)."""

    info: TensorInfo

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> np.dtype:
        return self.info.np_dtype

    @property
    def ndim(self) -> int:
        return len(self.info.shape)

    @property
    def nbytes(self) -> int:
        return self.info.nbytes

    def __getitem__(self, index) -> np.ndarray:
        return read_block(self.info, index)

    def __array__(self, dtype=None, copy=None):
        array = read_tensor(self.info)
        return array if dtype is None else array.astype(dtype)
