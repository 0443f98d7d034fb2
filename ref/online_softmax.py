"""The online-softmax state of blocked attention: (m, l, O) — row max, softmax denominator,
unnormalized output — updated one KV block at a time (`step`), rescaled (`carry`), merged
over independent pieces (`merge`), ordered (`after`) and normalized (`finish`). The pieces
`ref.attention.blocked` and the vision tower's tiled attention are built from.

Queries come grouped by kv head: `q [B, Hkv, g, S, D]` (kv head j serves query heads
j·g … j·g+g−1), masks broadcastable to `[B, Hkv, g, S, T]` (`grouped_mask`).
"""

import jax
import jax.numpy as jnp


def acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def grouped_mask(mask, hkv, g):
    """A mask broadcastable to [B, H, S, T] as one broadcastable to [B, Hkv, g, S, T]."""
    mask = jnp.asarray(mask)
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return jnp.broadcast_to(mask, (mask.shape[0], hkv * g, *mask.shape[2:])).reshape(
        mask.shape[0], hkv, g, *mask.shape[2:]
    )


def step(state, q, k, v, mask, *, scale, softcap):
    """One online-softmax update of (m, l, O) with a KV block; `state` None starts afresh.

    q: [B, Hkv, g, S, D]; k, v: [B, Hkv, Tb, D]; mask: bool broadcastable to
    [B, Hkv, g, S, Tb]; state: (m, l [B, Hkv, g, S, 1], O [B, Hkv, g, S, D]) in float32 (float64
    for float64 q). `m' = max(m, rowmax S)`, `p = exp(S − m')`, `l' = l·e^(m−m') + Σp`,
    `O' = O·e^(m−m') + p·V`, with masked scores out of both max and sum: a row that has seen no
    key keeps m = −inf, l = 0, O = 0.
    """
    acc = acc_dtype(q.dtype)
    kt = jnp.swapaxes(k.astype(q.dtype), -1, -2)[:, :, None]
    scores = jnp.matmul(q, kt) * jnp.asarray(scale, q.dtype)
    scores = scores.astype(acc)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask, scores, -jnp.inf)
    # lax, not jnp.max: jnp refuses a reduction over a symbolic (maybe empty) block of keys
    m_new = jax.lax.reduce_max(scores, (scores.ndim - 1,))[..., None]
    if state is not None:
        m_new = jnp.maximum(state[0], m_new)
    shift = shift_of(m_new)
    p = jnp.where(mask, jnp.exp(scores - shift), 0.0)
    pv = jnp.matmul(p.astype(q.dtype), v.astype(q.dtype)[:, :, None]).astype(acc)
    return carry(state, m_new, shift, jnp.sum(p, axis=-1, keepdims=True), pv)


def carry(state, m_new, shift, l_new, pv):
    """(m, l, O) after one block with row max m_new (the running max), shift `shift_of(m_new)`,
    its exp-sums l_new and its p·V: those alone for a fresh state, else the old state rescaled by
    e^(m − shift) plus them."""
    if state is None:
        return m_new, l_new, pv
    m, denom, o = state
    alpha = jnp.exp(m - shift)
    return m_new, denom * alpha + l_new, o * alpha + pv


def shift_of(m):
    """What exp() subtracts for row maxima m: m, or 0 where a row has seen no key (m = −inf),
    so that exp(−inf − shift) = 0. Not `max(m, lowest float32)`: on a float16 device that
    constant rounds to −inf and −inf − (−inf) is NaN (`verify --precision fp16` named it)."""
    return jnp.where(m > -jnp.inf, m, 0.0)


def merge(states):
    """Combine (m, l, O) states (m, l [..., R, 1], O [..., R, D]) of disjoint KV pieces computed
    independently (head-parallel), stacked on a new axis as QEfficient's prefill merge does: a
    handful of operations however many pieces."""
    m = jnp.concatenate([m for m, _, _ in states], axis=-1)
    denom = jnp.concatenate([denom for _, denom, _ in states], axis=-1)
    o = jnp.concatenate([o.reshape(*o.shape[:-1], 1, o.shape[-1]) for _, _, o in states], -2)
    m_all = jnp.max(m, axis=-1, keepdims=True)
    weights = jnp.exp(m - shift_of(m_all))
    l_all = jnp.sum(weights * denom, axis=-1, keepdims=True)
    o_all = jnp.sum(weights.reshape(*weights.shape, 1) * o, axis=-2)
    return m_all, l_all, o_all


def after(state, *xs):
    """xs, made to depend on the whole of an online-softmax `state` without changing a value.

    state: (m, l, O); xs: arrays → tuple of each x + 0·max(l), cast to x's dtype. Exact: l is
    finite, non-negative and at most the number of keys seen, so the product is 0 in float16 too
    (a sum of l over rows instead overflowed float16 at 420 queries of 420 keys: 0·inf = NaN). A
    max over all of l, not one element, so no simplifier can shrink the dependency to part of the
    block before: a scheduler that starts every independent matmul early (XLA:CPU does, and
    strips optimization barriers; onnxruntime too) still holds one block's scores at a time.
    """
    denom = state[1]
    # lax, not jnp.max: jnp refuses a reduction over a symbolic (maybe empty) block
    zero = jax.lax.reduce_max(denom, tuple(range(denom.ndim))) * 0
    return tuple(x + zero.astype(x.dtype) for x in xs)


def finish(state, dtype):
    """O / l, zeros where no key was visible → [..., S, D] in dtype."""
    _, denom, o = state
    return (o / jnp.where(denom > 0, denom, 1.0)).astype(dtype)
