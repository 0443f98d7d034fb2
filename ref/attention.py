"""Masked softmax attention in the QAIC KV-cache layout.

`attend` is the one dense kernel every other function here reduces to.
"""

import jax.numpy as jnp


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
    t = k.shape[2]
    qg = q.reshape(b, hkv, g * s, d)
    kt = jnp.swapaxes(k.astype(q.dtype), -1, -2)
    scores = jnp.matmul(qg, kt) * jnp.asarray(scale, q.dtype)
    scores = scores.astype(jnp.promote_types(q.dtype, jnp.float32))
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    m = jnp.broadcast_to(mask, (b, h, s, t)).reshape(b, hkv, g * s, t)
    scores = jnp.where(m, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.where(m, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.matmul(p.astype(q.dtype), v.astype(q.dtype))
    return out.reshape(b, h, s, d)
