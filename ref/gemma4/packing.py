"""Host-side packing metadata for the packed vision tower (numpy only; never a device array).

Items (images or video frames) of mixed sizes are concatenated into one sequence of patches
with no padding inside any item. Optionally the sequence is padded to a fixed patch budget
with one filler item (segment id −1) that attends to nothing and that nothing attends to.
"""

from dataclasses import dataclass

import numpy as np

from ref import validate


@dataclass(frozen=True)
class Packing:
    """Metadata of one packed batch. N = patches (budget included), M = soft tokens.

    grids: per item (h, w) in patches; positions: [N, 2] int32 (x = column, y = row);
    segment_ids: [N] int32 item index, −1 for filler; cu_seqlens: [items + 1] int32 patch
    offsets; pool_index: [M, k·k] int32 indices into the packed
    sequence, row-major over each item's (h/k, w/k) grid; cu_tokens: [items + 1] soft-token
    offsets; num_real_patches / num_real_tokens exclude the filler.
    """

    grids: tuple
    positions: np.ndarray
    segment_ids: np.ndarray
    cu_seqlens: np.ndarray
    pool_index: np.ndarray
    cu_tokens: np.ndarray
    num_real_patches: int
    num_real_tokens: int

    @property
    def cu_seqlens_static(self):
        """cu_seqlens as a tuple of ints, hashable for jit static arguments."""
        return tuple(int(c) for c in self.cu_seqlens)


def _check_grids(grids, kernel, max_position):
    """Validate grids: a non-empty list of (h, w) positive multiples of `kernel` in the table."""
    grids = tuple((int(h), int(w)) for h, w in grids) if len(grids) else ()
    if not grids:
        raise ValueError("empty input: expected at least one (h, w) grid")
    for i, (h, w) in enumerate(grids):
        if h <= 0 or w <= 0 or h % kernel or w % kernel:
            raise ValueError(
                f"grid {i} = ({h}, {w}): sides must be positive multiples of the pooling "
                f"kernel {kernel}"
            )
        if max(h, w) > max_position:
            raise ValueError(
                f"grid {i} = ({h}, {w}): positions up to {max(h, w) - 1} exceed the position "
                f"table of {max_position} entries"
            )
    return grids


def _item_pool_index(h, w, kernel, offset):
    """Indices of each k×k block of one row-major h×w grid → [(h/k)·(w/k), k·k]."""
    ty, tx, dy, dx = np.meshgrid(
        np.arange(h // kernel),
        np.arange(w // kernel),
        np.arange(kernel),
        np.arange(kernel),
        indexing="ij",
    )
    idx = (ty * kernel + dy) * w + tx * kernel + dx + offset
    return idx.reshape(-1, kernel * kernel)


def pack(grids, *, pooling_kernel_size=3, position_embedding_size=10240, budget=None):
    """Packing metadata for items with the given (h, w) grids.

    budget: None, or a soft-token budget M; the sequence is then padded to M·k² patches with a
    filler item (positions 0, segment −1) whose soft tokens come last.
    """
    k = int(pooling_kernel_size)
    grids = _check_grids(grids, k, position_embedding_size)
    sizes = np.array([h * w for h, w in grids], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    n_real = int(cu[-1])
    positions = [
        np.stack(np.meshgrid(np.arange(w), np.arange(h), indexing="xy"), -1).reshape(-1, 2)
        for h, w in grids
    ]
    segments = [np.full(s, i) for i, s in enumerate(sizes)]
    pools = [_item_pool_index(h, w, k, off) for (h, w), off in zip(grids, cu[:-1], strict=True)]
    cu_tokens = np.concatenate([[0], np.cumsum(sizes // (k * k))]).astype(np.int32)
    n_tokens = int(cu_tokens[-1])
    if budget is not None:
        budget = int(budget)
        if budget < n_tokens:
            raise ValueError(
                f"budget={budget} soft tokens is smaller than the {n_tokens} the items need"
            )
        fill = budget * k * k - n_real
        positions.append(np.zeros((fill, 2), np.int64))
        segments.append(np.full(fill, -1))
        pools.append(np.arange(n_real, n_real + fill).reshape(-1, k * k))
    return Packing(
        grids=grids,
        positions=np.concatenate(positions).astype(np.int32),
        segment_ids=np.concatenate(segments).astype(np.int32),
        cu_seqlens=cu,
        pool_index=np.concatenate(pools).astype(np.int32),
        cu_tokens=cu_tokens,
        num_real_patches=n_real,
        num_real_tokens=n_tokens,
    )


def pack_patches(patches, grids, patch_dim, packing):
    """Concatenate per-item patches and pad to the packing's length with zeros.

    patches: sequence of [h_i·w_i, patch_dim] arrays in [0, 1] → [N, patch_dim] float32.
    """
    if len(patches) != len(grids):
        raise ValueError(f"{len(patches)} patch arrays for {len(grids)} grids: expected one each")
    for i, (p, (h, w)) in enumerate(zip(patches, grids, strict=True)):
        shape = np.shape(p)
        if len(shape) != 2 or shape[1] != patch_dim:
            raise ValueError(f"patches[{i}] has shape {shape}: expected [{h * w}, {patch_dim}]")
        if shape[0] != h * w:
            raise ValueError(
                f"patches[{i}] has {shape[0]} patches but grid ({h}, {w}) needs {h * w}"
            )
        validate.finite(f"patches[{i}]", p)
    flat = np.concatenate([np.asarray(p, np.float32) for p in patches])
    fill = len(packing.segment_ids) - len(flat)
    return np.concatenate([flat, np.zeros((fill, patch_dim), np.float32)])
