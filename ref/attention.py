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


def mask(q_pos, kv_pos, *, sliding_window=None, q_group=None, kv_group=None):
    """Gemma 4 attention mask from positions: [B, S], [B, T] int (−1 = padding) → [B, 1, S, T].

    True where the query and key are both valid and (kv_pos ≤ q_pos, or both lie in the same
    vision run ≥ 0), and, given a sliding window W, q_pos − kv_pos < W. As in transformers'
    `sliding_window_overlay`, the window bounds only the past (`kv > q − W`), so a later key
    of the same vision run stays visible: sliding = AND(window, OR(causal, same run)).
    """
    q_pos = jnp.asarray(q_pos)
    kv_pos = jnp.asarray(kv_pos)
    qp = q_pos[:, None, :, None]
    kp = kv_pos[:, None, None, :]
    visible = kp <= qp
    if (q_group is None) != (kv_group is None):
        raise ValueError("q_group and kv_group must be given together (vision run ids, -1 = text)")
    if q_group is not None:
        qg = jnp.asarray(q_group)[:, None, :, None]
        kg = jnp.asarray(kv_group)[:, None, None, :]
        visible = visible | ((qg == kg) & (qg >= 0))
    if sliding_window is not None:
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        visible = visible & (qp - kp < sliding_window)
    return visible & (qp >= 0) & (kp >= 0)


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
):
    """Dense masked attention in the QAIC cache layout — the answer every blocked mode equals.

    q: [B, H, S, D]; k, v: [B, Hkv, T, D]; q_pos, q_group: [B, S]; kv_pos, kv_group: [B, T]
    (int, −1 = padding / text) → [B, H, S, D]. See `mask` for which keys a query sees.
    """
    m = mask(q_pos, kv_pos, sliding_window=sliding_window, q_group=q_group, kv_group=kv_group)
    return attend(q, k, v, m, scale=scale, softcap=softcap)
