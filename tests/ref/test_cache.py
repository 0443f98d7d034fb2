"""Cache operations against numpy oracles, and the retained-state handoff: chunked prefill
through the cache (linear and sliding-window ring) equals one dense `reference` over the whole
sequence (float64, ≤ 1e-12 relative)."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref import cache
from ref.attention import blocked, reference
from tests.util import examples, jitted


def chunks(rng, n):
    """Random chunk lengths summing to n."""
    cuts = np.sort(
        rng.choice(np.arange(1, n), size=rng.integers(0, min(n - 1, 3) + 1), replace=False)
    )
    return np.diff(np.concatenate([[0], cuts, [n]]))


@settings(max_examples=examples(15))
@given(
    st.integers(1, 2),
    st.sampled_from([4, 9]),
    st.sampled_from([1, 3, 6]),
    st.integers(0, 2**32 - 1),
)
def test_scatter_writes_valid_slots_and_nothing_else(b, t, s, seed):
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(b, 2, t, 3))
    new = rng.normal(size=(b, 2, s, 3))
    slots = np.full((b, s), -1)
    for row in range(b):
        pick = rng.permutation(t + 3)[:s] - 1  # distinct, some −1 and some ≥ T
        slots[row, : len(pick)] = pick
    want = old.copy()
    want_pos = np.full((b, t), -1)
    for row in range(b):
        for i, slot in enumerate(slots[row]):
            if 0 <= slot < t:
                want[row, :, slot] = new[row, :, i]
                want_pos[row, slot] = 100 + i
    assert (np.asarray(jitted(cache.scatter, old, new, slots)) == want).all()
    got_pos = jitted(
        cache.scatter_positions, np.full((b, t), -1), 100 + np.arange(s)[None].repeat(b, 0), slots
    )
    assert (np.asarray(got_pos) == want_pos).all()


@settings(max_examples=examples(10))
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([1, 3]), st.integers(0, 2**32 - 1))
def test_scatter_into_rows_writes_valid_pairs_only(b, f, s, seed):
    """Continuous batching's write straight into a cache of F slots: new's row b lands in
    cache row rows[b] at slots[b] (distinct valid rows; −1 or ≥ F rows and −1 or ≥ T slots
    write nothing), against a numpy loop, exactly; nothing else changes."""
    rng = np.random.default_rng(seed)
    t = 5
    old = rng.normal(size=(f, 2, t, 3))
    new = rng.normal(size=(b, 2, s, 3))
    rows = (rng.permutation(f + 3)[:b] - 1).astype(np.int32)  # distinct, some −1 and ≥ F
    slots = np.stack([rng.permutation(t + 3)[:s] - 1 for _ in range(b)]).astype(np.int32)

    def loop(old, new):
        want = old.copy()
        for i in range(b):
            for j in range(s):
                if 0 <= rows[i] < f and 0 <= slots[i, j] < t:
                    want[rows[i], :, slots[i, j]] = new[i, :, j]
        return want

    got = np.asarray(jitted(cache.scatter, old, new, slots, rows))
    assert got.dtype == old.dtype and (got == loop(old, new)).all()
    k, v = jitted(cache.update, old, old + 1, new, new - 1, slots, rows)
    assert (np.asarray(k) == loop(old, new)).all()
    assert (np.asarray(v) == loop(old + 1, new - 1)).all()
    with pytest.raises(ValueError, match=r"rows \[B\]"):
        cache.scatter(old, new, slots, rows[:, None])


def test_fold_and_errors():
    x = np.arange(2 * 3 * 5 * 1).reshape(2, 3, 5, 1)
    folded = np.asarray(cache.fold(x))
    assert folded.shape == (1, 6, 5, 1)
    assert (folded[0, 1 * 3 + 2] == x[1, 2]).all()  # row b·Hkv + h
    assert (np.asarray(cache.unfold(folded, 2)) == x).all()
    with pytest.raises(ValueError, match="unfold"):
        cache.unfold(folded, 4)
    with pytest.raises(ValueError, match="scatter expects"):
        cache.scatter(x, x[:, :2], np.zeros((2, 5), int))
    with pytest.raises(ValueError, match="window"):
        cache.rolling_slots(np.zeros((1, 2), int), 0)


def _prefill_chunk(ck, cv, q, k, v, pos, *, chunk_blocks):
    """One chunk of chunked prefill, compiled as one program (`tests.util.jitted`): write its
    K/V into the linear cache, attend over the slots ≤ its last position → (ck, cv, out)."""
    ck, cv = cache.update(ck, cv, k, v, pos)
    kv_pos = cache.causal_positions(pos, ck.shape[2])
    out = blocked(q, ck, cv, pos, kv_pos, mode="prefill_online",
                  prefill_block_chunks=chunk_blocks, num_kv_blocks=2, skip_kv=True)  # fmt: skip
    return ck, cv, out


@settings(max_examples=examples(5))
@given(st.integers(2, 12), st.integers(0, 2**32 - 1))
def test_chunked_prefill_through_the_cache_equals_one_shot(n, seed):
    """Each chunk writes its K/V (the returned caches feed the next chunk), then attends in the
    prefill_online mode over slots ≤ its last position; one batch row is shorter (padding)."""
    rng = np.random.default_rng(seed)
    b, h, hkv, d, t = 2, 4, 2, 4, n + 3
    q = rng.normal(size=(b, h, n, d)) * 0.5
    k = rng.normal(size=(b, hkv, n, d))
    v = rng.normal(size=(b, hkv, n, d))
    pos = np.arange(n)[None].repeat(b, 0)
    pos[1, n - rng.integers(0, n) :] = -1
    want = np.asarray(reference(q, k, v, pos, pos))
    ck = cv = np.zeros((b, hkv, t, d))
    outs, start = [], 0
    for size in chunks(rng, n):
        part = slice(start, start + size)
        chunk_blocks = int(rng.integers(1, size + 1))
        ck, cv, out = jitted(
            _prefill_chunk, ck, cv, *(x[:, :, part] for x in (q, k, v)), pos[:, part],
            chunk_blocks=chunk_blocks,
        )  # fmt: skip
        outs.append(out)
        start += size
    got = np.concatenate(outs, axis=2)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def _ring_chunk(ring_k, ring_v, ring_pos, q, k, v, pos, *, window):
    """One chunk through a sliding-window ring, compiled as one program: attend over the ring
    and the chunk's own keys, then write the ring → (ring_k, ring_v, ring_pos, out)."""
    kk, vv, kv_pos = cache.window_keys(ring_k, ring_v, ring_pos, k, v, pos)
    out = blocked(q, kk, vv, pos, kv_pos, mode="kv", num_kv_blocks=2, sliding_window=window)
    slots = cache.rolling_slots(pos, window)
    ring_k, ring_v = cache.update(ring_k, ring_v, k, v, slots)
    return ring_k, ring_v, cache.scatter_positions(ring_pos, pos, slots), out


@settings(max_examples=examples(5))
@given(st.integers(2, 14), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_sliding_window_ring_equals_one_shot(n, window, seed):
    """A ring of W slots (position p in slot p mod W), chunks longer or shorter than W: each
    chunk attends over ring + its own keys, then writes the ring; equals the windowed reference."""
    rng = np.random.default_rng(seed)
    b, h, hkv, d = 1, 2, 1, 4
    q = rng.normal(size=(b, h, n, d)) * 0.5
    k = rng.normal(size=(b, hkv, n, d))
    v = rng.normal(size=(b, hkv, n, d))
    pos = np.arange(n)[None]
    want = np.asarray(reference(q, k, v, pos, pos, sliding_window=window))
    ring_k = ring_v = np.zeros((b, hkv, window, d))
    ring_pos = np.full((b, window), -1)
    outs, start = [], 0
    for size in chunks(rng, n):
        part = slice(start, start + size)
        ring_k, ring_v, ring_pos, out = jitted(
            _ring_chunk, ring_k, ring_v, ring_pos, *(x[:, :, part] for x in (q, k, v)),
            pos[:, part], window=window,
        )  # fmt: skip
        outs.append(out)
        start += size
        held = np.sort(np.asarray(ring_pos)[0])
        assert list(held[held >= 0]) == list(range(max(0, start - window), start))
    got = np.concatenate(outs, axis=2)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_scatter_three_rows_three_heads_against_a_loop():
    """Batch and kv-head counts of 3 (the broadcast index grids must be [B,1,1] and [1,Hkv,1]),
    slots −1, T and T + 1 write nothing; a loop over rows and heads is the oracle."""
    rng = np.random.default_rng(3)
    b, hkv, t, s, d = 3, 3, 5, 3, 2
    old = rng.normal(size=(b, hkv, t, d))
    new = rng.normal(size=(b, hkv, s, d))
    slots = np.array([[4, 0, -1], [t, 2, t + 1], [1, 3, 2]])
    want = old.copy()
    for row in range(b):
        for head in range(hkv):
            for i, slot in enumerate(slots[row]):
                if 0 <= slot < t:
                    want[row, head, slot] = new[row, head, i]
    assert (np.asarray(cache.scatter(old, new, slots)) == want).all()
    k, v = cache.update(old, old + 1, new, new + 1, slots)
    assert (np.asarray(k) == want).all() and (np.asarray(v) == want + 1).all()


def test_scatter_casts_to_the_cache_dtype_itself():
    """The new values are cast explicitly: no implicit unsafe scatter cast (JAX warns now and
    will raise later), the result keeps the cache's dtype."""
    old = np.zeros((1, 1, 3, 2), np.float32)
    new = np.full((1, 1, 1, 2), 0.1)  # float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = cache.scatter(old, new, np.array([[1]]))
        pos = cache.scatter_positions(
            np.full((1, 3), -1, np.int32), np.array([[7]], np.int64), np.array([[2]])
        )
    assert got.dtype == np.float32 and np.asarray(got)[0, 0, 1].tolist() == [np.float32(0.1)] * 2
    assert pos.dtype == np.int32 and np.asarray(pos).tolist() == [[-1, -1, 7]]


def test_scatter_rejects_a_slots_shape_alone():
    x = np.zeros((2, 1, 4, 3))
    with pytest.raises(ValueError, match="scatter expects"):
        cache.scatter(x, x[:, :, :2], np.zeros((2, 3), int))
    with pytest.raises(ValueError, match="scatter expects"):
        cache.scatter(x, x[:, :, :2], np.zeros((1, 2), int))


def test_causal_positions_exact():
    got = cache.causal_positions(np.array([[0, 1], [3, -1], [-1, -1]]), 5)
    assert np.asarray(got).tolist() == [
        [0, 1, -1, -1, -1],
        [0, 1, 2, 3, -1],
        [-1, -1, -1, -1, -1],
    ]
    assert np.asarray(cache.causal_positions(np.array([[2]]), 4)).tolist() == [[0, 1, 2, -1]]


def rolling_slots_oracle(positions, window):
    """Per row: a position is written iff ≥ 0 and no later position of the row evicts it."""
    out = np.full(positions.shape, -1)
    for row, ps in enumerate(positions):
        last = ps.max()
        for i, p in enumerate(ps):
            if p >= 0 and last - p < window:
                out[row, i] = p % window
    return out


def test_rolling_slots_exact():
    """Rows of different lengths (each row evicts against its own last position), padding −1
    in a row whose positions are all < W, a chunk longer than W."""
    positions = np.array([[0, 1, 2, 3, 4, 5], [6, 7, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1]])
    got = np.asarray(cache.rolling_slots(positions, 3))
    assert got.tolist() == [[-1, -1, -1, 0, 1, 2], [0, 1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1]]
    assert (got == rolling_slots_oracle(positions, 3)).all()
    one = np.array([[4, 5, 6]])
    assert np.asarray(cache.rolling_slots(one, 2)).tolist() == [[-1, 1, 0]]
    assert np.asarray(cache.rolling_slots(one, 4)).tolist() == [[0, 1, 2]]


def test_window_keys_keeps_the_ring_dtypes():
    ring_k = np.zeros((1, 1, 2, 2), np.float32)
    ring_pos = np.full((1, 2), -1, np.int32)
    new = np.ones((1, 1, 1, 2))  # float64
    k, v, pos = cache.window_keys(ring_k, ring_k + 2, ring_pos, new, new * 3, np.array([[5]]))
    assert k.dtype == v.dtype == np.float32 and pos.dtype == np.int32
    assert np.asarray(k)[0, 0].tolist() == [[0, 0], [0, 0], [1, 1]]
    assert np.asarray(v)[0, 0].tolist() == [[2, 2], [2, 2], [3, 3]]
    assert np.asarray(pos).tolist() == [[-1, -1, 5]]


def test_take_and_put_rows_by_slot():
    """Continuous batching's slot reads and writes, against numpy indexing: −1 reads slot 0
    and ≥ F the last slot (ignored), and they write nothing; other rows untouched."""
    rng = np.random.default_rng(3)
    full = {"k": rng.standard_normal((4, 3, 5)), "pos": np.arange(20).reshape(4, 5)}
    rows = np.array([2, -1, 3, 0, 9])
    got = cache.take_rows(full, rows)
    np.testing.assert_array_equal(np.asarray(got["k"]), full["k"][[2, 0, 3, 0, 3]])
    np.testing.assert_array_equal(np.asarray(got["pos"]), full["pos"][[2, 0, 3, 0, 3]])
    new = {"k": rng.standard_normal((3, 3, 5)), "pos": -np.arange(15).reshape(3, 5)}
    put = cache.put_rows(full, new, np.array([3, -1, 0]))
    want_k, want_pos = full["k"].copy(), full["pos"].copy()
    want_k[3], want_k[0] = new["k"][0], new["k"][2]
    want_pos[3], want_pos[0] = new["pos"][0], new["pos"][2]
    np.testing.assert_array_equal(np.asarray(put["k"]), want_k)
    np.testing.assert_array_equal(np.asarray(put["pos"]), want_pos)
    assert np.asarray(put["pos"]).dtype == full["pos"].dtype
    beyond = cache.put_rows(full, new, np.array([4, 7, -3]))
    np.testing.assert_array_equal(np.asarray(beyond["k"]), full["k"])
