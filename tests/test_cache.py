"""Cache operations against numpy oracles, and the retained-state handoff: chunked prefill
through the cache (linear and sliding-window ring) equals one dense `reference` over the whole
sequence (float64, ≤ 1e-12 relative)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref import cache
from ref.attention import blocked, reference


def chunks(rng, n):
    """Random chunk lengths summing to n."""
    cuts = np.sort(
        rng.choice(np.arange(1, n), size=rng.integers(0, min(n - 1, 3) + 1), replace=False)
    )
    return np.diff(np.concatenate([[0], cuts, [n]]))


@settings(max_examples=15)
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
    assert (np.asarray(cache.scatter(old, new, slots)) == want).all()
    got_pos = cache.scatter_positions(
        np.full((b, t), -1), 100 + np.arange(s)[None].repeat(b, 0), slots
    )
    assert (np.asarray(got_pos) == want_pos).all()


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


@settings(max_examples=5)
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
        ck, cv = cache.update(ck, cv, k[:, :, part], v[:, :, part], pos[:, part])
        kv_pos = cache.causal_positions(pos[:, part], t)
        chunk_blocks = int(rng.integers(1, size + 1))
        outs.append(
            blocked(
                q[:, :, part],
                ck,
                cv,
                pos[:, part],
                kv_pos,
                mode="prefill_online",
                prefill_block_chunks=chunk_blocks,
                num_kv_blocks=2,
                skip_kv=True,
            )
        )
        start += size
    got = np.concatenate(outs, axis=2)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


@settings(max_examples=5)
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
        kk, vv, kv_pos = cache.window_keys(
            ring_k, ring_v, ring_pos, k[:, :, part], v[:, :, part], pos[:, part]
        )
        outs.append(
            blocked(
                q[:, :, part],
                kk,
                vv,
                pos[:, part],
                kv_pos,
                mode="kv",
                num_kv_blocks=2,
                sliding_window=window,
            )
        )
        slots = cache.rolling_slots(pos[:, part], window)
        ring_k, ring_v = cache.update(ring_k, ring_v, k[:, :, part], v[:, :, part], slots)
        ring_pos = cache.scatter_positions(ring_pos, pos[:, part], slots)
        start += size
        held = np.sort(np.asarray(ring_pos)[0])
        assert list(held[held >= 0]) == list(range(max(0, start - window), start))
    got = np.concatenate(outs, axis=2)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()
