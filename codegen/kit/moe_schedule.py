"""The schedule of one MoE mode, as a kernel author reads it: work items, their order, costs.

`python -m codegen plan --op moe --mode dense|gather|nsp [--opt k=v ...] [--png FILE]` prints,
per core (nsp) or for the one core (dense, gather), the expert matmuls run, the rows they
compute and how many of those are tokens routed to that expert, the matmul FLOPs and the bytes
of expert weights read, beside dense; and draws the items (`codegen.kit.draw.draw_moe`).

The work is that of `ref.gemma4.moe`'s functions, on the routing `codegen.kit.vectors` draws for the
same options (seed 0 unless given):

- dense: one item per expert over all T tokens (rows routed: the tokens that picked it).
- gather: one item per (token, pick): the picked expert's matrices over one row.
- nsp: per local slot s, per `packed_chunk`-row chunk, per core c (the cores at once): expert
  s·num_nsp + c over the chunk of its packed tokens (rows routed: those below the expert's
  routed count; the rest are computed and left out).

Cost model: an item over R rows of expert e reads e's gate_up and down once (3·I·D weights at
the weights' item size) and does 2·R·D·2I + 2·R·I·D matmul FLOPs; gelu, the product, the
weighting and the sums are left out (O(R·I) and O(R·D) beside the matmuls' O(R·I·D)).
"""

import dataclasses

import numpy as np

from codegen.kit.schedule import ratio, si
from codegen.kit.vector_options import moe_mode, moe_routing, moe_sizes

_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclasses.dataclass(frozen=True)
class Item:
    """One expert's matmuls over a range of rows.

    order: 1-based place in the schedule (items of one step on different cores share it:
    they run at once); core, slot: where the expert sits (nsp: expert slot·num_nsp + core;
    else core 0, slot = expert); expert; rows: half-open range of the rows it computes (dense:
    tokens; gather: the token's pick k, (k, k+1); nsp: packed rows); token: gather's token
    (None otherwise); routed: rows of the range that are tokens routed to the expert.
    """

    order: int
    core: int
    slot: int
    expert: int
    rows: tuple
    token: int | None
    routed: int


@dataclasses.dataclass(frozen=True)
class MoeCost:
    """Counts of one core's items, or of a whole schedule."""

    items: int = 0
    rows: int = 0
    routed: int = 0
    flops: int = 0
    weight_bytes: int = 0

    def __add__(self, other):
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return MoeCost(*(a + b for a, b in pairs))


def schedule(mode, num_experts, index, num_nsp=None, packed_chunk=None):
    """Every item of `mode` ("dense", "gather", "nsp") for the picks index [T, K] → tuple of
    Item in execution order."""
    t, k = index.shape
    count = np.bincount(index.reshape(-1), minlength=num_experts)
    if mode == "dense":
        return tuple(Item(e + 1, 0, e, e, (0, t), None, int(count[e])) for e in range(num_experts))
    if mode == "gather":
        picks = [(n, j, int(index[n, j])) for n in range(t) for j in range(k)]
        return tuple(Item(i + 1, 0, e, e, (j, j + 1), n, 1) for i, (n, j, e) in enumerate(picks))
    items, order = [], 0
    for slot in range(num_experts // num_nsp):
        for start in range(0, t, packed_chunk):
            order += 1
            for core in range(num_nsp):
                e = slot * num_nsp + core
                routed = int(min(max(count[e] - start, 0), packed_chunk))
                items.append(
                    Item(order, core, slot, e, (start, start + packed_chunk), None, routed)
                )
    return tuple(items)


def item_cost(item, hidden, intermediate, itemsize):
    rows = item.rows[1] - item.rows[0]
    return MoeCost(
        items=1,
        rows=rows,
        routed=item.routed,
        flops=2 * rows * hidden * 2 * intermediate + 2 * rows * intermediate * hidden,
        weight_bytes=itemsize * 3 * intermediate * hidden,
    )


def costs(items, hidden, intermediate, itemsize):
    """({core: MoeCost}, total MoeCost) of a schedule."""
    per = {}
    for item in items:
        cost = item_cost(item, hidden, intermediate, itemsize)
        per[item.core] = per.get(item.core, MoeCost()) + cost
    total = MoeCost()
    for cost in per.values():
        total = total + cost
    return per, total


_HEADER = (
    f"{'core':>6} {'items':>6} {'experts':>12} {'rows':>7} {'routed':>7} {'FLOPs':>9} "
    f"{'weight B':>9}"
)


def _row(label, experts, cost):
    return (
        f"{label:>6} {cost.items:>6} {experts:>12} {cost.rows:>7} {cost.routed:>7} "
        f"{si(cost.flops):>9} {si(cost.weight_bytes):>9}"
    )


def table(title, items, per, total, dense):
    lines = [title, _HEADER]
    for core, cost in per.items():
        experts = sorted({i.expert for i in items if i.core == core})
        shown = ",".join(map(str, experts[:4])) + (",..." if len(experts) > 4 else "")
        lines.append(_row(str(core), shown, cost))
    lines.append(_row("total", "", total))
    lines.append(_row("dense", "", dense))
    lines.append(
        f"{'':>6} mode/dense: FLOPs {ratio(total.flops, dense.flops)}, weight bytes "
        f"{ratio(total.weight_bytes, dense.weight_bytes)}"
    )
    lines.append(
        "items: expert matmuls (gate_up then down) over a range of rows; rows: rows computed;\n"
        "routed: of those, tokens routed to the item's expert; weight B: expert weights read"
    )
    return "\n".join(lines)


def report(mode, options, dtype="float16", seed=0):
    """Everything the CLI needs: items, routing, per-core and total costs, dense, title."""
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(_ITEMSIZE)}")
    t, d, e, i, k = moe_sizes(options)
    how = moe_mode(mode, options)
    _, index = moe_routing(options, np.random.default_rng(seed))
    items = schedule(mode, e, index, how.num_nsp, how.packed_chunk)
    per, total = costs(items, d, i, _ITEMSIZE[dtype])
    _, dense = costs(schedule("dense", e, index), d, i, _ITEMSIZE[dtype])
    title = (
        f"moe mode {how}; T={t} D={d} E={e} I={i} K={k}, hot={options['hot']}; routing of seed "
        f"{seed}; weights {dtype}"
    )
    return {
        "op": "moe",
        "mode": how,
        "index": index,
        "items": items,
        "per": per,
        "total": total,
        "dense": dense,
        "title": title,
        "table": table(title, items, per, total, dense),
    }
