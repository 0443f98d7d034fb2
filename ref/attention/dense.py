"""The dense attention kernel, the Gemma 4 mask and `reference`, with the argument checks the
blocked modes share (`ref.attention.blocks`)."""

import jax.numpy as jnp

from ref import online_softmax as osm
from ref import validate
from ref.cache import take_rows


def attend(q, k, v, mask, *, scale=1.0, softcap=None):
    """Dense masked attention with float32 softmax; a fully masked row returns zeros.

    q: [B, H, S, D]; k, v: [B, Hkv, T, D] with H % Hkv == 0 (kv head j serves query heads
    j·g … j·g+g−1); mask: bool, broadcastable to [B, H, S, T] (True = attend) → [B, H, S, D]
    in q's dtype (float64 inputs compute in float64).
    """
    b, h, s, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {hkv}")
    g = h // hkv
    m = osm.grouped_mask(mask, hkv, g)
    state = osm.step(None, q.reshape(b, hkv, g, s, d), k, v, m, scale=scale, softcap=softcap)
    return osm.finish(state, q.dtype).reshape(b, h, s, d)


def mask(q_pos, kv_pos, *, sliding_window=None, q_group=None, kv_group=None):
    """Gemma 4 attention mask from positions: [B, S], [B, T] int (−1 = padding) → [B, 1, S, T].

    True where the query and key are both valid and (kv_pos ≤ q_pos, or both lie in the same
    vision run ≥ 0), and, given a sliding window W, q_pos − kv_pos < W. As in transformers'
    `sliding_window_overlay`, the window bounds only the past (`kv > q − W`), so a later key
    of the same vision run stays visible: sliding = AND(window, OR(causal, same run)).
    """
    if (q_group is None) != (kv_group is None):
        raise ValueError("q_group and kv_group must be given together (vision run ids, -1 = text)")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return _visible(_side(q_pos, q_group), _side(kv_pos, kv_group, keys=True), sliding_window)


def _side(pos, group, *, keys=False, ndim=4):
    """One side of `mask`: positions [B, L] (and vision runs) as [B, 1, …, L, 1] (queries) or
    [B, 1, …, 1, L] (keys) of `ndim` dimensions, with their validity, so the blocked path can cut
    them once per block and combine any two."""
    pos = jnp.asarray(pos)
    tail = (1, pos.shape[1]) if keys else (pos.shape[1], 1)
    shape = (pos.shape[0], *(1,) * (ndim - 3), *tail)
    p = jnp.reshape(pos, shape)
    g = None if group is None else jnp.reshape(jnp.asarray(group), shape)
    return p, g, p >= 0, None if g is None else g >= 0


def _visible(q_side, kv_side, sliding_window):
    """`mask` from a query side [B, 1, …, S, 1] and a key side [B, 1, …, 1, T] (`_side`)."""
    qp, qg, q_valid, q_run = q_side
    kp, kg, kv_valid, _ = kv_side
    visible = kp <= qp
    if qg is not None:
        visible = visible | ((qg == kg) & q_run)
    if sliding_window is not None:
        visible = visible & (qp - kp < sliding_window)
    return visible & q_valid & kv_valid


def reference(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    *,
    sliding_window=None,
    q_group=None,
    kv_group=None,
    scale=1.0,
    softcap=None,
    cache_rows=None,
):
    """Dense masked attention in the QAIC cache layout — the answer every blocked mode equals.

    q: [B, H, S, D]; k, v: [B, Hkv, T, D]; q_pos, q_group: [B, S]; kv_pos, kv_group: [B, T]
    (int, −1 = padding / text) → [B, H, S, D]. See `mask` for which keys a query sees.
    cache_rows: None, or [B] int (continuous batching): k, v hold F cache slots [F, Hkv, T, D]
    and batch row b attends to slot cache_rows[b] (`ref.cache.take_rows`: a row outside
    [0, F) reads the nearest slot, its answer is not used).
    """
    k, v = _rows_of(k, v, q, cache_rows)
    _check_values(q, k, v, q_pos, kv_pos)
    _check_positions(q, k, q_pos, kv_pos, q_group, kv_group, k_batch=True)
    m = mask(q_pos, kv_pos, sliding_window=sliding_window, q_group=q_group, kv_group=kv_group)
    return attend(q, k, v, m, scale=scale, softcap=softcap)


def _rows_of(k, v, q, cache_rows):
    """(k, v) at the batch's cache slots cache_rows [B] (`take_rows`), or as given (None)."""
    if cache_rows is None:
        return k, v
    _check_cache_rows(q, cache_rows)
    return take_rows((k, v), cache_rows)


def _check_cache_rows(q, cache_rows):
    """Raise ValueError unless cache_rows is [B] for q [B, H, S, D]."""
    shape = tuple(jnp.asarray(cache_rows).shape)
    if shape != (q.shape[0],):
        raise ValueError(f"cache_rows has shape {shape}; expected ({q.shape[0]},), one cache "
                         f"slot per batch row of q {tuple(q.shape)}")  # fmt: skip


def _check_values(q, k, v, q_pos, kv_pos):
    """Eager calls only (traced values pass): finite q, k, v; positions ≥ −1."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        validate.finite(name, x)
    validate.positions("q_pos", q_pos)
    validate.positions("kv_pos", kv_pos)


def _check_positions(q, k, q_pos, kv_pos, q_group, kv_group, *, k_batch):
    """Raise ValueError unless positions and groups are [B, S] / [B, T] for q [B, H, S, D] and a
    cache of T slots (k [B, Hkv, T, D] when k_batch; else [1, B·Hkv, T, D] folded or
    [F, Hkv, T, D] cache slots)."""
    b, _, s, _ = q.shape
    t = k.shape[2]
    expected = {"q_pos": (b, s), "kv_pos": (b, t), "q_group": (b, s), "kv_group": (b, t)}
    given = {"q_pos": q_pos, "kv_pos": kv_pos, "q_group": q_group, "kv_group": kv_group}
    for name, value in given.items():
        # `.shape`, not jnp.shape: jax2onnx patches jnp.shape to return a traced array.
        shape = None if value is None else tuple(jnp.asarray(value).shape)
        if shape is not None and shape != expected[name]:
            raise ValueError(
                f"{name} has shape {shape}; expected {expected[name]} for q {tuple(q.shape)} "
                f"and k {tuple(k.shape)}"
            )
    if k_batch and k.shape[0] != b:
        raise ValueError(f"k batch {k.shape[0]} does not match q batch {b}")
