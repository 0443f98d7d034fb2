"""The audio tower's chunked local attention over packed clips, as transformers computes it.

Per clip, tokens are cut into chunks of C queries from the clip's first token; chunk b, starting
at token s, reads the C + P + F keys s − P … s + C + F − 1 (P = attention_context_left − 1 past,
F = attention_context_right future). Its scores are Transformer-XL's: `q·k` plus `q·r`, where
the relative table r has npos = (C + P + F) // 2 + 1 rows, row j the sinusoid of position
npos − 1 − j, projected by `relative_k_proj`; `rel_shift` gives slot c of query i the row c − i
(zero where that is npos or more). Then the soft cap `cap · tanh(s / cap)`, then the mask:
slot c is visible from query i when its distance d = P + i − c is 0 ≤ d < P or 0 < −d < F
(transformers' sliding window) and the key is in the clip; hidden ones get `invalid` (−1e9),
whose exp is exactly 0, or −cap − 128 in its place (`mask_fill`: the same softmax in float32,
and finite in float16). Softmax in float32 (at least).

With P = C = 12, F = 0 (the released config) a frame sees itself and its 11 past frames, the
pair at distance d reading row 12 − d, the sinusoid of position d. Chunk boundaries never change
which keys a query sees: its window always lies inside its chunk's context. The plain dense form
of the same numbers is `ref.gemma4.audio_reference.reference`.

Chunks are gathered by host-made index arrays (`ref.gemma4.audio_packing.chunk_index`): static
shapes, no chunk crosses a clip, a key outside the clip reads the appended zero row.
"""

import jax
import jax.numpy as jnp
import numpy as np


def gather_rows(x, index):
    """x gathered by row, index N reading a zero row: x [N, ...]; index [...] int in [0, N] →
    [..., ...]. A clamped gather and a select rather than a zero row appended: in an exported
    graph N is a specialization symbol, and jax2onnx 0.17 declares a concatenation along a
    symbolic axis with a wrong shape (onnxruntime then fails)."""
    n = x.shape[0]
    rows = x[jnp.minimum(index, n - 1)]
    inside = (index < n).reshape(*index.shape, *([1] * (x.ndim - 1)))
    return jnp.where(inside, rows, jnp.zeros((), x.dtype))


def window(chunk, past, future):
    """Which context slot each query of a chunk sees: [C, C + P + F] bool (slot c of a chunk at s
    holds key s − P + c; query i, at s + i, is at distance d = P + i − c from it; visible when
    0 ≤ d < P or 0 < −d < F)."""
    d = past + np.arange(chunk)[:, None] - np.arange(chunk + past + future)[None, :]
    return ((d >= 0) & (d < past)) | ((d < 0) & (-d < future))


def rel_shift(x, context):
    """Transformer-XL's shift: [..., C, npos] → [..., C, context], slot c of row i holding column
    c − i (zero where c − i ≥ npos; c < i reads the row above: masked slots only)."""
    *lead, c, npos = x.shape
    # zeros concatenated, not `jnp.pad`: ONNX Pad is not on the QAIC allow-list
    x = jnp.concatenate([x, jnp.zeros((*lead, c, context + 1 - npos), x.dtype)], axis=-1)
    x = x.reshape(*lead, c * (context + 1))[..., : c * context]
    return x.reshape(*lead, c, context)


def capped_masked_logits(scores, visible, cap, invalid):
    """The soft cap, then the mask: `cap · tanh(s / cap)` where visible, `invalid` elsewhere.

    scores: [...]; visible: bool broadcastable to scores → scores' shape and dtype.
    """
    capped = jnp.tanh(scores / cap) * cap
    return jnp.where(visible, capped, jnp.asarray(invalid, scores.dtype))


def mask_fill(invalid, cap):
    """The logit hidden keys get: max(invalid, −cap − 128). Float32 gives both the same softmax
    (a visible logit is above −cap, and e^−128 underflows to 0; a row with every key hidden
    averages either way); transformers' −1e9 rounds to −inf in float16, where the filler chunks'
    rows, every key hidden, turned softmax NaN (`verify --precision fp16` named it)."""
    return max(float(invalid), -float(cap) - 128.0)


def chunked_attention(q, k, v, rel_k, queries, keys, slots, *, past, future, cap, invalid):
    """Chunked local attention of packed clips.

    q, k, v: [M, H, D] (q, k already scaled); rel_k: [npos, H, D]; queries: [B, C], keys:
    [B, C + P + F] int (M = outside the clip); slots: [M] int into the B·C chunk rows → [M, H, D].
    """
    m, h, d = q.shape
    b, c = queries.shape
    context = keys.shape[1]
    qc = jnp.swapaxes(gather_rows(q, queries), 1, 2)  # [B, H, C, D]
    kc = jnp.swapaxes(gather_rows(k, keys), 1, 2)  # [B, H, X, D]
    vc = jnp.swapaxes(gather_rows(v, keys), 1, 2)
    ac = jnp.matmul(qc, jnp.swapaxes(kc, -1, -2))  # [B, H, C, X]
    bd = jnp.matmul(qc, jnp.transpose(rel_k, (1, 2, 0)).astype(q.dtype))  # [B, H, C, npos]
    visible = jnp.asarray(window(c, past, future)) & (keys < m)[:, None, None, :]
    logits = capped_masked_logits(
        ac + rel_shift(bd, context), visible, cap, mask_fill(invalid, cap)
    )
    acc = jnp.promote_types(q.dtype, jnp.float32)
    weights = jax.nn.softmax(logits.astype(acc), axis=-1).astype(v.dtype)
    out = jnp.swapaxes(jnp.matmul(weights, vc), 1, 2).reshape(b * c, h, d)
    return out[slots]
