"""The schedule of the audio tower's chunked local attention, as a kernel author reads it: which
keys each query chunk reads and sees, clip by clip, and its cost beside dense attention.

`python -m codegen plan --op audio_attention [--opt clips=120,64,80 ...] [--png FILE]` prints
one row per chunk and the totals beside dense attention over the packed tokens, and draws the
chunks over the packed (query, key) plane (`codegen.kit.draw.draw_audio`).

The chunks are the index arrays of `ref.gemma4.audio_packing.pack` (what
`ref.gemma4.audio_attention.chunked_attention` gathers): chunk b holds queries s … s + C − 1 of
one clip and its window of C + P + F context slots, keys s − P … s + C + F − 1; a slot outside
the clip reads a zero row and is masked. Which slot a query sees is the chunked function's own
mask (`window`, and keys inside the clip).

Cost model. Every chunk of the static shapes is computed, filler chunks (no real query) too:
per chunk H·C·X scores (X = C + P + F); QK^T 2·H·C·X·D FLOPs plus the relative term q·rel_k
2·H·C·npos·D; PV 2·H·C·X·D; H·C·X exps. Bytes: the q and output rows of its real queries and the
K and V rows it reads inside the clip (a zero row is never loaded). Peak working memory: one
chunk's float32 scores and relative scores, 4·H·C·(X + npos). Dense
(`ref.gemma4.audio_reference.reference` over the M packed tokens): one tile of H·M·M scores,
H·M·npos relative scores, q, k, v and the output loaded or stored once.
"""

import dataclasses

import numpy as np

from codegen.kit.schedule import Cost, range_text, ratios, si, span
from codegen.kit.vector_options import audio_packing
from ref.gemma4.audio_attention import window

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
_NONE = (0, 0)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One query chunk; ranges are half-open packed token ranges (start, end), (0, 0) for none.

    order: 1-based (chunk row b + 1); clip: its clip's index (None: a filler chunk); queries:
    its real queries; window: its C + P + F slots' packed positions (may leave the clip and the
    array); keys: the window's part inside the clip (the keys it reads); seen: the keys some
    query of the chunk sees; visible: its visible (query, key) pairs.
    """

    order: int
    clip: int | None
    queries: tuple
    window: tuple
    keys: tuple
    seen: tuple
    visible: int


def _extent(index):
    """(first, last + 1) of packed indices [n] int, (0, 0) when empty."""
    return (int(index.min()), int(index.max()) + 1) if len(index) else _NONE


def chunk_masks(config, packing):
    """The chunked function's mask per chunk: [B, C, X] bool, query slot i of chunk b sees
    slot c (its window, the key inside the clip, the query real)."""
    a, m = packing.arrays, len(packing.segment_ids)
    c, past, future = config.attention_chunk_size, config.max_past, config.attention_context_right
    inside = (a["chunk_queries"] < m)[:, :, None] & (a["chunk_keys"] < m)[:, None, :]
    return window(c, past, future)[None] & inside


def _chunk(order, queries, keys, seen, segment_ids, past):
    """One Chunk from its index rows: queries [C], keys [X] int (M: none), seen [C, X] bool;
    segment_ids [M]; past P."""
    m = len(segment_ids)
    real = queries[queries < m]
    if not len(real):
        return Chunk(order, None, _NONE, _NONE, _NONE, _NONE, 0)
    first = int(real[0]) - past
    return Chunk(
        order=order,
        clip=int(segment_ids[real[0]]),
        queries=_extent(real),
        window=(first, first + len(keys)),
        keys=_extent(keys[keys < m]),
        seen=_extent(keys[seen.any(0)]),
        visible=int(seen.sum()),
    )


def chunks(config, packing):
    """Every chunk in order → tuple of Chunk."""
    a = packing.arrays
    rows = zip(a["chunk_queries"], a["chunk_keys"], chunk_masks(config, packing), strict=True)
    return tuple(
        _chunk(b + 1, *row, packing.segment_ids, config.max_past) for b, row in enumerate(rows)
    )


def visible_pairs(config, packing):
    """The chunked function's mask over the packed tokens: [M, M] bool, query t sees key s."""
    a, m = packing.arrays, len(packing.segment_ids)
    out = np.zeros((m, m), bool)
    b, i, c = np.nonzero(chunk_masks(config, packing))
    out[a["chunk_queries"][b, i], a["chunk_keys"][b, c]] = True
    return out


def chunk_cost(chunk, config, itemsize):
    """Cost of one chunk (the module docstring's model)."""
    h, d = config.num_attention_heads, config.head_dim
    rows, npos = h * config.attention_chunk_size, config.relative_positions
    scores = rows * config.context_size
    return Cost(
        computed=int(chunk.clip is not None),
        empty=int(chunk.clip is None),
        qk_flops=2 * (scores + rows * npos) * d,
        pv_flops=2 * scores * d,
        exps=scores,
        bytes=itemsize * 2 * h * d * (span(chunk.queries) + span(chunk.keys)),
        peak=4 * (scores + rows * npos),
    )


def dense_cost(config, tokens, itemsize):
    """Cost of dense attention over `tokens` packed tokens, one tile."""
    h, d, npos = config.num_attention_heads, config.head_dim, config.relative_positions
    scores = h * tokens * tokens
    return Cost(
        computed=1,
        qk_flops=2 * (scores + h * tokens * npos) * d,
        pv_flops=2 * scores * d,
        exps=scores,
        bytes=itemsize * 4 * h * tokens * d,
        peak=4 * (scores + h * tokens * npos),
    )


_HEADER = (
    f"{'chunk':>5} {'clip':>4} {'queries':>8} {'window':>8} {'reads':>8} {'sees':>8} "
    f"{'pairs':>6} {'QK^T+rel':>9} {'PV flop':>8} {'exp':>6} {'bytes':>7} {'peak B':>7}"
)


def _line(label, chunk, cost):
    where = ["", "", "", "", "", ""]
    if chunk is not None:
        clip = "-" if chunk.clip is None else str(chunk.clip)
        spans = (chunk.queries, chunk.window, chunk.keys, chunk.seen)
        where = [clip, *(range_text(r) if r != _NONE else "-" for r in spans), str(chunk.visible)]
    return (
        f"{label:>5} {where[0]:>4} {where[1]:>8} {where[2]:>8} {where[3]:>8} {where[4]:>8} "
        f"{where[5]:>6} {si(cost.qk_flops):>9} {si(cost.pv_flops):>8} {si(cost.exps):>6} "
        f"{si(cost.bytes):>7} {si(cost.peak):>7}"
    )


def describe(config, packing, dtype):
    """One-line title: clips, tokens, chunking, sizes."""
    m, c = len(packing.segment_ids), config.attention_chunk_size
    past, future = config.max_past, config.attention_context_right
    return (
        f"audio chunked attention; clips of {','.join(map(str, packing.frame_counts))} frames "
        f"-> {','.join(map(str, packing.token_counts))} soft tokens, M={m} packed; C={c} P={past} "
        f"F={future} ({config.context_size} slots per chunk, {config.relative_positions} "
        f"relative positions); H={config.num_attention_heads} D={config.head_dim}; cap "
        f"{config.attention_logit_cap:g}; q/k/v/o {dtype}"
    )


def report(options, dtype="float16"):
    """Everything the CLI needs: config, packing, chunks, the packed mask [M, M], per-chunk and
    total costs, dense, title, table."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_ITEMSIZE)}")
    config, packing = audio_packing(options)
    found = chunks(config, packing)
    per = [chunk_cost(c, config, _ITEMSIZE[dtype]) for c in found]
    total = Cost()
    for cost in per:
        total = total + cost
    dense = dense_cost(config, len(packing.segment_ids), _ITEMSIZE[dtype])
    title = describe(config, packing, dtype)
    lines = [title, _HEADER, *(_line(str(c.order), c, k) for c, k in zip(found, per, strict=True))]
    lines += [_line("total", None, total), _line("dense", None, dense)]
    lines += [
        f"{'':>5} chunked/dense: {ratios(total, dense)}",
        "window: the chunk's C+P+F slots (outside the clip: a zero row, masked); reads: its keys\n"
        "inside the clip; sees: keys some query of the chunk sees; pairs: visible (query, key)",
    ]
    return {
        "op": "audio_attention",
        "config": config,
        "packing": packing,
        "chunks": found,
        "visible": visible_pairs(config, packing),
        "per": per,
        "total": total,
        "dense": dense,
        "title": title,
        "table": "\n".join(lines),
    }
