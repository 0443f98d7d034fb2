"""Compute context lengths (QEfficient's CCL) of the language graphs: a graph given lengths K
takes an input `comp_ctx_lengths` [K] (int64, its length read only) and attends to the first
K cache slots, one specialization per K. Here: the checked lengths, what the trace may assume
of the symbol, and the specializations they multiply.
"""

from codegen.graphs import GraphError

CCL = "comp_ctx_lengths"  # QEfficient's input and symbol: the graph reads its length only


def check_ccls(ccls, ctx_len, seq_len, phase, multiple=1):
    """Compute context lengths as a sorted tuple of distinct ints in [seq_len, ctx_len] (a
    prefill chunk of seq_len tokens starting at 0 needs K ≥ seq_len), each a multiple of
    `multiple` (the phase's blocking cuts K into exact KV blocks and pieces:
    `BlockingConfig.kv_multiple`), raising GraphError naming the first bad value."""
    ccls = tuple(ccls or ())
    for k in ccls:
        if isinstance(k, bool) or not isinstance(k, int) or not seq_len <= k <= ctx_len:
            raise GraphError(
                f"{phase} compute context length {k!r}: expected an int in "
                f"[seq_len={seq_len}, ctx_len={ctx_len}]"
            )
        if k % multiple:
            raise GraphError(
                f"{phase} compute context length {k}: {phase} blocking cuts it into exact KV "
                f"blocks (× head-parallel pieces) of {multiple}; expected a multiple of {multiple}"
            )
    if list(ccls) != sorted(set(ccls)):
        raise GraphError(f"{phase} compute context lengths {list(ccls)}: expected increasing")
    return ccls


def ccl_constraints(ctx_len, multiple):
    """What the trace may assume of the symbol comp_ctx_lengths (`check_ccls` holds them)."""
    out = (f"{CCL} <= {ctx_len}", f"{CCL} >= {multiple}")
    return out + ((f"mod({CCL}, {multiple}) == 0",) if multiple > 1 else ())


def specializations(phase, base, budgets, ccls):
    """One specialization per vision budget (prefill with vision; else one) × per compute
    context length (none: the graph's one shape): [{"name", "symbols"}]."""
    per_budget = (
        [(f"prefill_{b}", {**base, "vision_size": b}) for b in budgets]
        if budgets
        else [(phase, base)]
    )
    if not ccls:
        return tuple({"name": n, "symbols": s} for n, s in per_budget)
    return tuple(
        {"name": f"{n}_ccl{k}", "symbols": {**s, CCL: k}} for k in ccls for n, s in per_budget
    )
