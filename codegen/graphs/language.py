"""The Gemma 4 language model as ONE QAIC program: prefill and decode as specializations of one
graph sharing one retained state, as QEfficient compiles Gemma 4's `lang` (its
`get_specializations` returns a prefill and a decode specialization of one graph). The KV cache
then never leaves the device between a prefill and a decode.

The graph is `codegen.graphs.model`'s (one `apply_step` over flat inputs, each decoder layer an
ONNX function) traced with `seq_len` symbolic, and `batch_size` too under continuous batching
(prefill rows batch_size, decode rows full_batch_size). It can be one graph only where both
phases take the same path at every size:
- blocking: dense attention in both phases (`none`). A blocked mode's plan is cut from the
  step's query count (prefill `q`, `qkv`, `online`), or differs between the phases (decode
  `kv_headpar` against prefill `qkv`): one graph cannot hold both, and `qaic-compile` is not
  known to prune a path per specialization, so such pairs stay two programs;
- MoE: the same mode in both phases, and not `nsp` (its packed chunks are cut from the step's
  token count). What QEfficient compiles by default, prefill `nsp` and decode `gather`, stays
  two programs, as QEfficient's MoE flow runs three QPCs;
- no batch fold (a decode layout of its own).

Specializations: per vision budget (× compute context length) a prefill one (`seq_len`,
`batch_size`, `vision_size` = the budget), and a decode one (`seq_len` 1, `batch_size` the
decode rows, `vision_size` 1: a decode step feeds a one-row `vision_embeds` of zeros; × each
decode compute context length). A phase given no compute context lengths binds
`comp_ctx_lengths` to ctx_len when the other has some (the graph then always takes it).
"""

from codegen.graphs import GraphError, GraphSpec, layer_function
from codegen.graphs.ccl import CCL, ccl_constraints, check_ccls
from codegen.graphs.decoder import cache_tensors, decoder_kinds, model_weights
from codegen.graphs.model import _checked_sizes, _forward, io_tensors, sized_options, step_fields
from ref import moe_modes
from ref.attention import reference


def one_program_refusal(prefill_blocking, decode_blocking, moe_prefill, moe_decode, folded):
    """Why the phases cannot be one program (None: they can): blocking modes as (mode,
    options), MoE modes as text (`ref.moe_modes`), folded: the decode folds the batch."""
    for phase, (mode, _) in (("prefill", prefill_blocking), ("decode", decode_blocking)):
        if mode not in (None, "none"):
            return f"{phase} blocking {mode!r} plans its blocks from the step's sizes"
    if folded:
        return "the decode folds the batch into the KV heads"
    if str(moe_prefill) != str(moe_decode):
        return f"MoE prefill {moe_prefill} and decode {moe_decode} take different paths"
    if moe_modes.parse(str(moe_prefill)).name == "nsp":
        return "MoE nsp cuts its chunks from the step's token count"
    return None


def language_graph(
    checkpoint_config,
    tensor_shapes,
    *,
    batch_size=1,
    seq_len,
    ctx_len,
    budgets=(),
    sliding_ring=True,
    full_batch_size=None,
    comp_ctx_lengths=(),
    decode_comp_ctx_lengths=(),
    moe="dense",
    drafts=0,
    use_functions=True,
):
    """The `language` graph: prefill (seq_len tokens of batch_size rows, the vision merge) and
    decode (one token of every row, or of every slot with full_batch_size) in one graph; see
    the module's docstring. comp_ctx_lengths / decode_comp_ctx_lengths: each phase's compute
    context lengths (QEfficient's CCL)."""
    cfg, batch_size, seq_len = _checked_sizes(
        checkpoint_config, "prefill", batch_size, seq_len, ctx_len, full_batch_size
    )
    vision = cfg.image_token_id is not None and bool(budgets)
    budgets = tuple(budgets) if vision else ()
    for budget in budgets:
        if not budget < ctx_len:
            raise GraphError(f"vision_size {budget} must be < ctx_len {ctx_len}")
    decode_rows = full_batch_size or batch_size
    try:
        experts = moe_modes.for_phase(moe, "prefill", cfg.num_experts, batch_size * seq_len)
        moe_modes.for_phase(moe, "decode", cfg.num_experts, decode_rows)
    except ValueError as e:
        raise GraphError(f"language graph: {e}") from e
    why = one_program_refusal(("none", {}), ("none", {}), experts, experts, False)
    if why is not None:
        raise GraphError(f"language graph: {why}; export prefill and decode apart")
    ccls = {
        "prefill": check_ccls(comp_ctx_lengths, ctx_len, seq_len, "prefill"),
        "decode": check_ccls(decode_comp_ctx_lengths, ctx_len, 1, "decode"),
    }
    takes_ccl = any(ccls.values())
    prefix, names = model_weights(cfg, tensor_shapes)
    kinds = decoder_kinds(cfg)
    rows = "batch_size" if full_batch_size is None else "full_batch_size"
    cache_in = cache_tensors(cfg, sliding_ring, ctx_len, rows, False, drafts)
    ids, outputs = io_tensors(cfg, vision, full_batch_size is not None, takes_ccl, cache_in)
    forward = _forward(cfg, vision, ids, cache_in, names, prefix, kinds, experts)
    if use_functions:
        for kind in set(kinds):
            layer_function(kind)
    static = {"ctx_len": ctx_len}
    static.update({"full_batch_size": full_batch_size} if full_batch_size else
                  {"batch_size": batch_size})  # fmt: skip
    specs = specializations(static, batch_size, seq_len, decode_rows, budgets, ccls, ctx_len)
    constraints = [f"seq_len <= {ctx_len}"]
    if full_batch_size is not None:
        constraints.append(f"batch_size <= {full_batch_size}")
    if takes_ccl:
        constraints += ccl_constraints(ctx_len, 1)
    if vision:
        constraints.append(f"vision_size <= {max(budgets)}")
    return GraphSpec(
        name="language",
        kind="language",
        options={
            **sized_options("none", {}, None, batch_size, seq_len, ctx_len),
            "budgets": list(budgets),
            "sliding_ring": sliding_ring,
            "full_batch_size": full_batch_size,
            "folded_cache": False,
            "comp_ctx_lengths": list(ccls["prefill"]),
            "decode_comp_ctx_lengths": list(ccls["decode"]),
            "moe": str(experts),
            "drafts": drafts,
            "layer_functions": sorted(set(kinds)),
        },
        specializations=specs,
        static=tuple(static),
        **step_fields(
            cfg,
            vision,
            (ids, cache_in, outputs),
            (prefix, names),
            forward(reference, use_functions),
            forward,
        ),  # fmt: skip
        constraints=tuple(constraints),
    )


def specializations(static, batch_size, seq_len, decode_rows, budgets, ccls, ctx_len):
    """[{"name", "symbols"}]: prefill per budget ("prefill_<b>", or "prefill" without vision),
    then decode, each × its phase's compute context lengths ("_ccl<K>"; ctx_len for a phase
    without any when the other has some)."""
    vision = {"vision_size": 1} if budgets else {}
    phases = {
        "prefill": [(f"prefill_{b}", {"vision_size": b}) for b in budgets] or [("prefill", {})],
        "decode": [("decode", vision)],
    }
    sizes = {"prefill": (batch_size, seq_len), "decode": (decode_rows, 1)}
    out = []
    for phase, named in phases.items():
        rows, tokens = sizes[phase]
        base = {**static, "batch_size": rows, "seq_len": tokens}
        lengths = ccls[phase] or ((ctx_len,) if any(ccls.values()) else ())
        for name, extra in named:
            if not lengths:
                out.append({"name": name, "symbols": {**base, **extra}})
            for k in lengths:
                out.append({"name": f"{name}_ccl{k}", "symbols": {**base, **extra, CCL: k}})
    return tuple(out)
