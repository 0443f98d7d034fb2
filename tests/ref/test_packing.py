"""Packing metadata against a loop-by-loop oracle, and exact refusals of bad input."""

import numpy as np
import pytest

from ref.gemma4.packing import pack, pack_patches


def oracle(grids, k, budget=None):
    """The packing spelled out patch by patch: row-major items, one after the other."""
    positions, segments, pools, cu, cu_tokens = [], [], [], [0], [0]
    for item, (h, w) in enumerate(grids):
        offset = cu[-1]
        for y in range(h):
            for x in range(w):
                positions.append((x, y))
                segments.append(item)
        for ty in range(h // k):
            for tx in range(w // k):
                pools.append(
                    [offset + (ty * k + dy) * w + tx * k + dx for dy in range(k) for dx in range(k)]
                )
        cu.append(offset + h * w)
        cu_tokens.append(cu_tokens[-1] + (h // k) * (w // k))
    if budget is not None:
        for _ in range(budget * k * k - cu[-1]):
            positions.append((0, 0))
            segments.append(-1)
        start = cu[-1]
        fill = range(budget - cu_tokens[-1])
        pools += [list(range(start + i * k * k, start + (i + 1) * k * k)) for i in fill]
    return positions, segments, pools, cu, cu_tokens


@pytest.mark.parametrize(
    ("grids", "k", "budget"),
    [
        ([(3, 6)], 3, None),
        ([(6, 3), (3, 3), (9, 6)], 3, None),
        ([(2, 4), (4, 2)], 2, 7),
        ([(3, 3)], 3, 1),  # a budget with no room for filler
        ([(1, 2), (3, 1)], 1, 9),
    ],
)
def test_pack_matches_the_oracle(grids, k, budget):
    got = pack(grids, pooling_kernel_size=k, budget=budget)
    positions, segments, pools, cu, cu_tokens = oracle(grids, k, budget)
    assert got.grids == tuple(grids)
    assert got.positions.tolist() == [list(p) for p in positions]
    assert got.segment_ids.tolist() == segments
    assert got.pool_index.tolist() == pools
    assert got.cu_seqlens.tolist() == cu and got.cu_seqlens_static == tuple(cu)
    assert got.cu_tokens.tolist() == cu_tokens
    assert (got.num_real_patches, got.num_real_tokens) == (cu[-1], cu_tokens[-1])
    for name in ("positions", "segment_ids", "pool_index", "cu_seqlens", "cu_tokens"):
        assert getattr(got, name).dtype == np.int32, name
    assert all(type(c) is int for c in got.cu_seqlens_static)
    assert type(got.num_real_patches) is int and type(got.num_real_tokens) is int


def test_pack_accepts_the_limits():
    """Sides equal to the position table, a budget of exactly the items' tokens, an array."""
    got = pack(np.array([[6, 3]]), position_embedding_size=6)
    assert got.grids == ((6, 3),) and got.positions.max(0).tolist() == [2, 5]
    assert len(pack([(3, 3), (3, 6)], budget=3).segment_ids) == 27
    assert pack([(3, 3)], budget=np.int64(2)).segment_ids.tolist() == [0] * 9 + [-1] * 9


@pytest.mark.parametrize(
    ("grids", "kwargs", "message"),
    [
        ([], {}, "empty input: expected at least one (h, w) grid"),
        (np.zeros((0, 2)), {}, "empty input: expected at least one (h, w) grid"),
        (
            [(3, 3), (0, 3)],
            {},
            "grid 1 = (0, 3): sides must be positive multiples of the pooling kernel 3",
        ),
        (
            [(3, 0)],
            {},
            "grid 0 = (3, 0): sides must be positive multiples of the pooling kernel 3",
        ),
        (
            [(1, 10241)],
            {"pooling_kernel_size": 1},  # the default table: 10240 positions
            "grid 0 = (1, 10241): positions up to 10240 exceed the position table of 10240 entries",
        ),
        (
            [(3, -3)],
            {},
            "grid 0 = (3, -3): sides must be positive multiples of the pooling kernel 3",
        ),
        (
            [(4, 6)],
            {},
            "grid 0 = (4, 6): sides must be positive multiples of the pooling kernel 3",
        ),
        (
            [(6, 4)],
            {},
            "grid 0 = (6, 4): sides must be positive multiples of the pooling kernel 3",
        ),
        (
            [(3, 9)],
            {"position_embedding_size": 8},
            "grid 0 = (3, 9): positions up to 8 exceed the position table of 8 entries",
        ),
        (
            [(9, 3)],
            {"position_embedding_size": 8},
            "grid 0 = (9, 3): positions up to 8 exceed the position table of 8 entries",
        ),
        (
            [(3, 3), (3, 6)],
            {"budget": 2},
            "budget=2 soft tokens is smaller than the 3 the items need",
        ),
    ],
)
def test_pack_refusals_exact(grids, kwargs, message):
    with pytest.raises(ValueError) as err:
        pack(grids, **kwargs)
    assert str(err.value) == message


def test_pack_patches_concatenates_and_pads_with_zeros():
    grids = [(1, 2), (2, 1)]
    packing = pack(grids, pooling_kernel_size=1, budget=6)
    patches = [np.array([[0.1, 0.2], [0.3, 0.4]]), np.array([[0.5, 0.6], [0.7, 0.8]])]
    got = pack_patches(patches, grids, 2, packing)
    assert got.dtype == np.float32
    want = np.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8], [0, 0], [0, 0]], np.float32)
    assert (got == want).all()
    exact = pack_patches(patches, grids, 2, pack(grids, pooling_kernel_size=1))
    assert (exact == want[:4]).all()


@pytest.mark.parametrize(
    ("patches", "message"),
    [
        ([np.zeros((2, 2))], "1 patch arrays for 2 grids: expected one each"),
        ([np.zeros((2, 2)), np.zeros(2)], "patches[1] has shape (2,): expected [2, 2]"),
        ([np.zeros((2, 3)), np.zeros((2, 2))], "patches[0] has shape (2, 3): expected [2, 2]"),
        (
            [np.zeros((2, 2)), np.zeros((3, 2))],
            "patches[1] has 3 patches but grid (2, 1) needs 2",
        ),
        (
            [np.zeros((2, 2)), np.array([[0.0, 0.0], [0.0, np.nan]])],
            "patches[1][1, 1] = nan: expected finite values",
        ),
    ],
)
def test_pack_patches_refusals_exact(patches, message):
    grids = [(1, 2), (2, 1)]
    with pytest.raises(ValueError) as err:
        pack_patches(patches, grids, 2, pack(grids, pooling_kernel_size=1))
    assert str(err.value) == message
