"""The audio tower's local attention written densely: every query against every key, one mask.

The answer `ref.gemma4.audio_attention.chunked_attention` must equal, written from the pair's
point of view and sharing no code with it (no chunks, no shift, no index arrays). Query t sees
key s when both belong to the same clip and their distance d = t − s satisfies 0 ≤ d < P (the
query itself and P − 1 past keys) or 0 < −d < F (F − 1 future keys), P = context_left − 1,
F = context_right. The pair's score is `q_t·k_s + q_t·rel_k[P − d]`, the second term zero when
P − d is not a row of rel_k (its npos rows hold positions npos − 1 … 0); then
`cap · tanh(score / cap)`, hidden pairs set to `invalid`, softmax in float32 (at least).
"""

import jax
import jax.numpy as jnp


def reference(q, k, v, rel_k, segment_ids, *, past, future, cap, invalid):
    """Dense local attention of packed clips.

    q, k, v: [M, H, D] (q, k already scaled); rel_k: [npos, H, D]; segment_ids: [M] int (clip
    index, −1 = filler: sees nothing, is seen by nothing) → [M, H, D] (filler rows: any values).
    """
    m = q.shape[0]
    npos = rel_k.shape[0]
    t = jnp.arange(m)
    d = t[:, None] - t[None, :]  # [M, M]: query t, key s
    seg = jnp.asarray(segment_ids)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    visible = same & (((d >= 0) & (d < past)) | ((d < 0) & (-d < future)))
    row = past - d
    q_rel = jnp.einsum("thd,rhd->htr", q, rel_k.astype(q.dtype))  # [H, M, npos]
    picked = jnp.take_along_axis(q_rel, jnp.clip(row, 0, npos - 1)[None], axis=2)
    rel = jnp.where((row >= 0) & (row < npos), picked, 0.0)
    scores = jnp.einsum("thd,shd->hts", q, k) + rel
    logits = jnp.where(visible, jnp.tanh(scores / cap) * cap, invalid)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    weights = jax.nn.softmax(logits.astype(acc), axis=-1).astype(v.dtype)
    return jnp.einsum("hts,shd->thd", weights, v)
