"""Packed vision attention tile by tile (`ref.gemma4.vision.tiled_packed_attention`) against an
independent numpy float64 oracle that attends within each segment on its own rows (no mask, no `ref`
code): ≤ 1e-12 relative in float64 for any query × KV tiling, any segment layout, filler
included."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref.gemma4.vision import check_tiles, packed_attention, tile_bounds, tiled_packed_attention
from tests.util import examples, jitted


def oracle(q, k, v, segment_ids):
    """Softmax attention among the rows of each segment ≥ 0; filler rows (−1) get zeros."""
    g = q.shape[1] // k.shape[1]
    out = np.zeros_like(q)
    for s in set(segment_ids.tolist()) - {-1}:
        rows = np.flatnonzero(segment_ids == s)
        for head in range(q.shape[1]):
            scores = q[rows, head] @ k[rows, head // g].T
            w = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[rows, head] = (w / w.sum(axis=1, keepdims=True)) @ v[rows, head // g]
    return out


@st.composite
def problems(draw):
    n = draw(st.integers(1, 30))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8]))
    ids = draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n))
    if draw(st.booleans()):
        ids = sorted(ids, key=lambda s: (s < 0, s))  # packed: items in order, filler last
    tiles = (draw(st.integers(1, min(n, 5))), draw(st.integers(1, min(n, 5))))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    scale = draw(st.sampled_from([0.1, 1.0, 3.0]))
    q = rng.normal(size=(n, heads, d)) * scale
    k = rng.normal(size=(n, kv_heads, d)) * scale
    v = rng.normal(size=(n, kv_heads, d))
    return q, k, v, np.asarray(ids, np.int32), tiles


@settings(max_examples=examples(20))
@given(problems())
def test_tiled_attention_equals_per_segment_oracle(problem):
    q, k, v, ids, tiles = problem
    got = np.asarray(jitted(tiled_packed_attention, q, k, v, ids, tiles=tiles))
    want = oracle(q, k, v, ids)
    assert got.dtype == np.float64
    assert np.all(got[ids < 0] == 0)
    assert np.abs(got - want).max() <= 1e-12 * max(np.abs(want).max(), 1e-300)


def test_packed_attention_masked_path_takes_the_tiles():
    """`packed_attention` without cu_seqlens runs the tiles it is given, and equals the
    per-item path (cu_seqlens) on a packed sequence."""
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(20, 4, 8)), rng.normal(size=(20, 2, 8)), rng.normal(size=(20, 2, 8))
    ids = np.array([0] * 9 + [1] * 6 + [-1] * 5, np.int32)
    got = np.asarray(packed_attention(q, k, v, ids, tiles=(4, 3)))
    assert np.array_equal(got, np.asarray(tiled_packed_attention(q, k, v, ids, (4, 3))))
    per_item = np.asarray(packed_attention(q, k, v, ids, cu_seqlens=(0, 9, 15)))
    assert np.abs(got - per_item).max() <= 1e-12 * np.abs(per_item).max()


@pytest.mark.parametrize(
    ("n", "tiles", "want"),
    [
        (9, 3, [(0, 3), (3, 6), (6, 9)]),
        (10, 3, [(0, 3), (3, 6), (6, 10)]),
        (5, 1, [(0, 5)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ],
)
def test_tile_bounds_cover_every_row_once(n, tiles, want):
    assert tile_bounds(n, tiles) == want


@pytest.mark.parametrize(
    ("tiles", "words"),
    [
        ((0, 1), ["query tiles 0", ">= 1"]),
        ((2, -1), ["KV tiles -1", ">= 1"]),
        ((2, 2.0), ["KV tiles 2.0", "int"]),
        ((11, 1), ["query tiles 11", "more than the 10 patches"]),
        ((1, 12), ["KV tiles 12", "more than the 10 patches"]),
        ((3,), ["tiles (3,)", "pair"]),
        ([3, 3], ["tiles [3, 3]", "pair"]),
    ],
)
def test_bad_tiles_are_named(tiles, words):
    with pytest.raises(ValueError) as e:
        check_tiles(tiles, 10)
    for w in words:
        assert w in str(e.value)


def test_gqa_heads_must_divide():
    q, kv = np.zeros((4, 3, 4)), np.zeros((4, 2, 4))
    with pytest.raises(ValueError, match="query heads 3 must be a multiple of kv heads 2"):
        tiled_packed_attention(q, kv, kv, np.zeros(4, np.int32), (2, 2))
