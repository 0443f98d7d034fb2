"""The kernels of `blocked` (`ref.attention.blocks`): one KV tile's online-softmax update of
(m, l, O) (`_tile`, state of `ref.online_softmax`), one query block against every KV block of a
plan (`_query_block`, `_cut_query_block`), and what they read, cut from the arrays by static
slices: each KV block's keys (`_keys`), its key side (`_kv_sides`), each tile's mask
(`_tile_masks`, `_bias`). `blocked` jits these per trace and walks the plan's loops over them."""

import functools

import jax.numpy as jnp

from ref import online_softmax as osm
from ref.attention.dense import _side, _visible
from ref.cache import span, take_rows


def _tile(state, q, kt, v, bias, *, scale, softcap):
    """One online-softmax update of (m, l, O) with one KV tile, the queries as matrix rows.

    q: [B, Hb, R·S, D] (R query heads of each of Hb kv heads × S queries, head-major); kt: the
    tile's keys transposed [B, Hb, D, T]; v: [B, Hb, T, D]; bias: [B, 1 | Hb, 1, S, T] (`_bias`),
    0 where a key is visible and −inf where not; state: (m, l [B, Hb, R·S, 1], O [B, Hb, R·S, D])
    in the accumulation dtype, or None. The recurrence of `online_softmax.step` in the shapes an
    export wants: plain matmuls with nothing broadcast (GQA rows share their kv head's K, never a
    copy of it), the mask as one add (x + 0 = x, and exp(−inf − shift) = 0 drops a masked key from
    max and sum exactly as a select does), no multiply for scale 1.
    """
    acc = osm.acc_dtype(q.dtype)
    scores = jnp.matmul(q, kt)
    if scale != 1.0:
        scores = scores * jnp.asarray(scale, q.dtype)
    scores = scores.astype(acc)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    b, hb, rows, t = scores.shape
    # no -1: a symbolic tile length (a compute context length's block) cannot be divided out
    scores = (scores.reshape(b, hb, rows // bias.shape[3], bias.shape[3], t) + bias).reshape(
        b, hb, rows, t
    )
    m_new = jnp.max(scores, axis=-1, keepdims=True)
    if state is not None:
        m_new = jnp.maximum(state[0], m_new)
    shift = osm.shift_of(m_new)
    p = jnp.exp(scores - shift)
    pv = jnp.matmul(p.astype(q.dtype), v).astype(acc)
    return osm.carry(state, m_new, shift, jnp.sum(p, axis=-1, keepdims=True), pv)


def _query_block(q, tiles, masks, prev, *, plan, scale, softcap):
    """One query block against every KV block of the plan.

    q: [B', Hb, R, S', D] (batch rows × kv heads × n_rep chunk × queries of the block); tiles:
    per KV block (K transposed [B', Hb, D, Tb], V [B', Hb, Tb, D]) (`_keys`); masks: per KV
    block (mask bool [B', 1 | Hb, 1, S', Tb], bias) (`_tile_masks`); prev: the state of the block
    computed before (None for the first; only `ordered` plans pass one). Sequential plans carry
    (m, l, O) from block to block; parallel (head-parallel) plans compute every block and piece
    from scratch and merge once. Returns (normalized [B', Hb, R, S', D], the last block's state
    when ordered, else None).
    """
    shape = q.shape
    q = q.reshape(shape[0], shape[1], shape[2] * shape[3], shape[4])
    step = functools.partial(_tile, scale=scale, softcap=softcap)
    state, finished = None, []
    for (t0, t1), (kt, vb), (m, bias) in zip(plan.kv, tiles, masks, strict=True):
        if plan.ordered and prev is not None:
            (q,) = osm.after(prev, q)
        if plan.parallel:
            cuts = _pieces(t1 - t0, plan.split)
            pieces = (
                [
                    step(None, q, span(kt, a, c, -1), span(vb, a, c, 2), span(bias, a, c, -1))
                    for a, c in cuts
                ]
                if len(cuts) > 1
                else [step(None, q, kt, vb, bias)]
            )
            new = osm.merge(pieces) if len(pieces) > 1 else pieces[0]
            old = None
        else:
            new = step(state, q, kt, vb, bias)
            old = state
        if plan.skip_kv:
            # One flag per block (as QEfficient's skip_kv) so a compiler can branch on it; a
            # block no query sees contributes nothing, so keeping the old state is exact.
            skip = ~jnp.any(m)
            old = old if old is not None else _empty(new)
            new = tuple(jnp.where(skip, a, b) for a, b in zip(old, new, strict=True))
        if plan.parallel:
            finished.append(new)
        else:
            state = new
        prev = new
    if plan.parallel:
        state = osm.merge(finished) if len(finished) > 1 else finished[0]
    return osm.finish(state, q.dtype).reshape(shape), prev if plan.ordered else None


def _keys(k, v, cache_rows, *, rows, heads, kv, dtype):
    """Per KV block (bounds `kv`) of batch rows × kv heads (bounds): (K transposed
    [B', Hb, D, Tb], V [B', Hb, Tb, D]) in dtype; made once per head block, read by every
    query block. cache_rows: None, or [B] int: k, v hold F cache slots and the batch rows read
    slots cache_rows[b0:b1], cut block by block (a KV block's rows are gathered, never the
    whole cache)."""
    (b0, b1), (kv0, kv1) = rows, heads

    def cut(x, t0, t1):
        if cache_rows is None:
            return span(x[b0:b1, kv0:kv1], t0, t1, 2)
        return take_rows(span(x[:, kv0:kv1], t0, t1, 2), cache_rows[b0:b1])

    blocks = [(cut(k, t0, t1), cut(v, t0, t1)) for t0, t1 in kv]
    return [(jnp.swapaxes(kb.astype(dtype), -1, -2), vb.astype(dtype)) for kb, vb in blocks]


def _cut_query_block(q, k, v, cache_rows, masks, prev, *, rows, heads, dtype, **block):
    """`_query_block` with each KV block's tile cut from k, v just before its use (`_keys` of
    that block alone), for a head block that one query block reads (decode: one query, one n_rep
    chunk). Cut all at once first, every tile of the head block is live together in a runtime
    that runs ready nodes in the listed order (a 31B full layer with 4 cache slots: ~4 GB)."""
    tiles = (
        _keys(k, v, cache_rows, rows=rows, heads=heads, kv=(t,), dtype=dtype)[0]
        for t in block["plan"].kv
    )
    return _query_block(q, tiles, masks, prev, **block)


def _kv_sides(kv_pos, kv_group, *, rows, kv):
    """Per KV block (bounds `kv`), the key side (`_side`) of batch rows (bounds; None: all) of
    kv_pos, kv_group [B, T]; made once per call, read by every query block's masks."""
    r = slice(*rows) if rows else slice(None)
    groups = [None if kv_group is None else span(kv_group[r], t0, t1, 1) for t0, t1 in kv]
    cuts = zip(kv, groups, strict=True)
    return [_side(span(kv_pos[r], t0, t1, 1), g, keys=True, ndim=5) for (t0, t1), g in cuts]


def _tile_masks(q_pos, q_group, kv_sides, *, window, fold):
    """Per KV block, the mask of one query block and its `_bias`: bool [B', 1, 1, S', Tb] —
    folded [1, Hb, 1, S', Tb] (`fold` = (B, Hkv, kv head bounds)), where row b·Hkv + j carries
    batch row b's positions — made once per query block from its positions q_pos, q_group
    [B', S'] and each KV block's key side (`_kv_sides`)."""
    q_side = _side(q_pos, q_group, ndim=5)
    out = []
    for kv_side in kv_sides:
        m = _visible(q_side, kv_side, window)
        if fold:
            b, hkv, (kv0, kv1) = fold
            m = jnp.broadcast_to(m, (b, hkv, *m.shape[2:])).reshape(1, b * hkv, *m.shape[2:])
            m = m[:, kv0:kv1]
        out.append((m, _bias(m)))
    return out


def _bias(m):
    """The additive mask `_tile` takes: bool m → 0 where visible and −inf where not, in float32
    (`_tile` adds it in the accumulation dtype: float32 or float64, both hold 0 and −inf
    exactly)."""
    return jnp.where(m, jnp.float32(0), jnp.float32(-jnp.inf))


def _pieces(n, split):
    """`split` near-equal pieces of `[0, n)` (ceil size, last one shorter, none empty); of a
    symbolic n (which split divides: `BlockingConfig.kv_multiple`), `split` exact ones."""
    if not isinstance(n, int):
        return [(i * (n // split), (i + 1) * (n // split)) for i in range(split)]
    size = -(-n // split)
    return [(i, min(i + size, n)) for i in range(0, n, size)]


def _empty(state):
    """The state of a row that has seen no key: m = −inf, l = 0, O = 0."""
    m, denom, o = state
    return jnp.full_like(m, -jnp.inf), jnp.zeros_like(denom), jnp.zeros_like(o)
