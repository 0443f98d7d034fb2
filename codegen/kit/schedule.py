"""The schedule of one blocked-attention mode, as a kernel author reads it: tiles, order, costs.

`python -m codegen plan --op attention --mode M [--opt k=v ...] [--batch B --heads H
--kv-heads HKV --seq S --ctx T --head-dim D] [--png FILE]` prints, per KV loop and in total,
the matmul FLOPs, exps, bytes moved and peak working memory beside dense attention, and draws
the mask, the tiles (computed / computed but fully masked / skipped), their order and how
partial results combine.

The blocks are `ref.blocking.BlockingConfig(...).plan(...)`'s; what is walked here is the loop
nest of `ref.attention.blocks._blocked` (batch block → head block → query-head range → query block →
KV block → pieces), and the pieces of a head-parallel block are `ref.blocking_plan.ranges` of it.

Cost model (one definition, used for dense too). A loop is one query block of one head range:
rows = batch rows × kv heads × query heads per kv head × queries. Per tile that is not skipped,
`n = rows × keys` scores: QK^T and PV are 2·n·D FLOPs each, and `exp(S − m)` is n exps; the
online update adds one exp per row for each tile after the loop's first computed one, a merge
one per row per merged piece. Bytes: each loop loads its q tile and stores its output once
(rows × D each), and every tile not skipped loads its K and V (batch rows × kv heads × keys × D
each), at the tensors' item size. Peak working memory: float32 scores of the tiles live at once
plus float32 states (m, l, O: rows × (D + 2)): one state for the sequential recurrence; for a
head-parallel loop every piece's state stays live until the one merge, and the pieces of a
block run at once. Loops run one after another, so the total peak is the largest loop's.
"""

import dataclasses

import jax

from codegen.kit.vector_options import (
    attention_mask,
    attention_sizes,
    blocking_config,
)
from ref.blocking_plan import Plan, ranges

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Tile:
    """One KV block of one loop. Ranges are half-open `(start, end)`.

    order: 1-based place in the schedule; loop: the loop it belongs to; step: its KV block's
    index in the loop; batch, kv_heads, reps, q, kv: the block's rows (with batch_fold:
    batch (0, 1) and kv_heads the folded rows b·Hkv + j); pieces: slots computed independently
    (one piece unless head-parallel); rows: batch rows whose mask applies; status: computed,
    empty (computed, nothing visible), skipped (nothing visible, skip_kv).
    """

    order: int
    loop: int
    step: int
    batch: tuple
    kv_heads: tuple
    reps: tuple
    q: tuple
    kv: tuple
    pieces: tuple
    rows: tuple
    status: str


@dataclasses.dataclass(frozen=True)
class Cost:
    """Counts of one loop, or of a whole schedule (peak: the largest loop's)."""

    computed: int = 0
    empty: int = 0
    skipped: int = 0
    qk_flops: int = 0
    pv_flops: int = 0
    exps: int = 0
    bytes: int = 0
    peak: int = 0

    def __add__(self, other):
        fields = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in _SUMMED}
        return Cost(**fields, peak=max(self.peak, other.peak))


_SUMMED = [f for f in dataclasses.fields(Cost) if f.name != "peak"]


def dense_plan(batch, heads, kv_heads, queries, cache_len):
    """Dense attention as a plan of one tile: all batch rows, heads, queries and slots."""
    group = heads // kv_heads
    return Plan(
        batch=((0, batch),),
        heads=((0, kv_heads, ((0, group),)),),
        q=((0, queries),),
        kv=((0, cache_len),),
        split=1,
        parallel=False,
        skip_kv=False,
        batch_fold=False,
    )


def make_plan(mode, options):
    """The plan of an attention mode for resolved options (`codegen.kit.vector_options.resolve`)."""
    b, h, hkv, s, t, _ = attention_sizes(options)
    config = blocking_config(mode, options)
    if config is None:
        return dense_plan(b, h, hkv, s, t)
    return config.plan(b, h, hkv, s, t, num_devices=jax.local_device_count())


def _mask_rows(plan, batch, kv_heads, hkv):
    """Batch rows whose mask a block uses: its batch rows, or with batch_fold the rows b of
    its folded kv rows b·Hkv + j."""
    if plan.batch_fold:
        return kv_heads[0] // hkv, (kv_heads[1] - 1) // hkv + 1
    return batch


def schedule(plan, visible, hkv):
    """Every tile of `plan` in execution order. visible: [B, S, T] bool (ref's mask);
    hkv: unfolded kv heads. → tuple of Tile."""
    tiles, loop = [], 0
    for batch in plan.batch:
        for j0, j1, reps in plan.heads:
            rows = _mask_rows(plan, batch, (j0, j1), hkv)
            for rep in reps:
                for q0, q1 in plan.q:
                    for step, (t0, t1) in enumerate(plan.kv):
                        cut = ranges(t1 - t0, plan.split) if plan.parallel else ((0, t1 - t0),)
                        seen = visible[rows[0] : rows[1], q0:q1, t0:t1].any()
                        status = "computed" if seen else "skipped" if plan.skip_kv else "empty"
                        tiles.append(
                            Tile(
                                order=len(tiles) + 1,
                                loop=loop,
                                step=step,
                                batch=batch,
                                kv_heads=(j0, j1),
                                reps=rep,
                                q=(q0, q1),
                                kv=(t0, t1),
                                pieces=tuple((t0 + a, t0 + c) for a, c in cut),
                                rows=rows,
                                status=status,
                            )
                        )
                    loop += 1
    return tuple(tiles)


def span(r):
    return r[1] - r[0]


def loop_cost(tiles, parallel, head_dim, itemsize):
    """Cost of one loop's tiles (see the module docstring for the model) → Cost."""
    first = tiles[0]
    heads = span(first.batch) * span(first.kv_heads)
    rows = heads * span(first.reps) * span(first.q)
    state = rows * (head_dim + 2)
    work = [t for t in tiles if t.status != "skipped"]
    scores = sum(rows * span(t.kv) for t in work)
    pieces = sum(len(t.pieces) for t in work)
    if parallel:
        combine = rows * pieces if pieces > 1 else 0
        live, peak = 0, state
        for t in work:
            live += len(t.pieces)
            peak = max(peak, rows * span(t.kv) + live * state)
    else:
        combine = rows * (len(work) - 1) if work else 0
        peak = max([state] + [rows * span(t.kv) + state for t in work])
    kv_bytes = sum(2 * heads * span(t.kv) * head_dim for t in work)
    return Cost(
        computed=sum(t.status == "computed" for t in tiles),
        empty=sum(t.status == "empty" for t in tiles),
        skipped=len(tiles) - len(work),
        qk_flops=2 * scores * head_dim,
        pv_flops=2 * scores * head_dim,
        exps=scores + combine,
        bytes=itemsize * (2 * rows * head_dim + kv_bytes),
        peak=4 * peak,
    )


def loops(tiles):
    """Tiles grouped by loop, in order → list of tuples."""
    out = {}
    for t in tiles:
        out.setdefault(t.loop, []).append(t)
    return [tuple(v) for v in out.values()]


def costs(plan, tiles, head_dim, itemsize):
    """(per-loop costs, total) of a schedule."""
    per = [loop_cost(group, plan.parallel, head_dim, itemsize) for group in loops(tiles)]
    total = Cost()
    for c in per:
        total = total + c
    return per, total


def si(x):
    """1234567 → '1.23M' (exact below 10 000)."""
    if x < 10_000:
        return str(int(x))
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return str(x)


def range_text(r):
    return f"{r[0]}:{r[1]}"


_HEADER = (
    f"{'loop':>5} {'batch':>6} {'kv heads':>9} {'q/kv':>5} {'queries':>8} {'tiles c/e/s':>12} "
    f"{'QK^T flop':>10} {'PV flop':>10} {'exp':>8} {'bytes':>9} {'peak B':>9}"
)


def _row(label, tile, cost):
    where = ("", "", "", "") if tile is None else (tile.batch, tile.kv_heads, tile.reps, tile.q)
    where = tuple(w if isinstance(w, str) else range_text(w) for w in where)
    tiles = f"{cost.computed}/{cost.empty}/{cost.skipped}"
    return (
        f"{label:>5} {where[0]:>6} {where[1]:>9} {where[2]:>5} {where[3]:>8} {tiles:>12} "
        f"{si(cost.qk_flops):>10} {si(cost.pv_flops):>10} {si(cost.exps):>8} "
        f"{si(cost.bytes):>9} {si(cost.peak):>9}"
    )


def ratio(a, b):
    """a / b to three decimals ("-" for b = 0)."""
    return f"{a / b:.3f}" if b else "-"


def ratios(total, dense):
    """Each count of `total` over dense's: 'qk_flops 1.000 pv_flops 1.000 …'."""
    return " ".join(
        f"{name} {ratio(getattr(total, name), getattr(dense, name))}"
        for name in ("qk_flops", "pv_flops", "exps", "bytes", "peak")
    )


def table(title, tiles, per, total, dense, max_rows=48):
    """The printed table: one row per loop (the first `max_rows`), total, dense, ratio."""
    groups = loops(tiles)
    lines = [title, _HEADER]
    for i, (group, cost) in enumerate(zip(groups, per, strict=True)):
        if i == max_rows:
            lines.append(f"{'...':>5} ({len(groups) - max_rows} more loops)")
            break
        lines.append(_row(str(i + 1), group[0], cost))
    lines.append(_row("total", None, total))
    lines.append(_row("dense", None, dense))
    lines.append(f"{'':>5} blocked/dense: {ratios(total, dense)}")
    lines.append(
        "tiles c/e/s: computed / computed but fully masked / skipped (skip_kv); q/kv: query\n"
        "heads j*g + r, r in this range, of each kv head j; peak B: live float32 scores + states"
    )
    return "\n".join(lines)


def describe(mode, options, dtype):
    """One-line title: mode, its block options, sizes, positions."""
    b, h, hkv, s, t, d = attention_sizes(options)
    blocking = blocking_config(mode, options)
    opts = ""
    if blocking is not None:
        keys = [f.name for f in dataclasses.fields(blocking) if f.name != "mode"]
        given = {k: getattr(blocking, k) for k in keys if getattr(blocking, k) not in (None, False)}
        opts = " (" + ", ".join(f"{k}={v}" for k, v in given.items()) + ")"
    start = t - s if options["q_start"] is None else options["q_start"]
    extra = [f"row 0 queries at {start}..{start + s - 1}"]
    if options["sliding_window"] is not None:
        extra.append(f"window {options['sliding_window']}")
    if options["vision"]:
        extra.append(f"vision run of {options['vision']} at query {options['vision_offset']}")
    return (
        f"mode {mode}{opts}; B={b} H={h} Hkv={hkv} S={s} T={t} D={d}; {', '.join(extra)}; "
        f"q/k/v/o {dtype}"
    )


def report(mode, options, dtype="float16"):
    """Everything the CLI needs: plan, tiles, per-loop and total costs, dense, title."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_ITEMSIZE)}")
    b, h, hkv, s, t, d = attention_sizes(options)
    plan = make_plan(mode, options)
    visible = attention_mask(options)
    tiles = schedule(plan, visible, hkv)
    per, total = costs(plan, tiles, d, _ITEMSIZE[dtype])
    dense = dense_plan(b, h, hkv, s, t)
    _, dense_cost = costs(dense, schedule(dense, visible, hkv), d, _ITEMSIZE[dtype])
    title = describe(mode, options, dtype)
    return {
        "plan": plan,
        "tiles": tiles,
        "visible": visible,
        "per": per,
        "total": total,
        "dense": dense_cost,
        "title": title,
        "table": table(title, tiles, per, total, dense_cost),
    }
