"""The Gemma 4 language model as QAIC graphs: `prefill` and `decode`, each one call of
`ref.gemma4.step.apply_step` with the KV cache as retained state.

I/O follows QEfficient's Gemma 4 language graph (`QEffGemma4DecoderWrapper`): `input_ids`,
`position_ids` (−1 = padding), `vision_embeds`, `image_idx` (prefill only),
`past_key.{i}` / `past_value.{i}` for every layer that owns a cache → `logits` (each row's
last valid position, soft-capped), `image_idx_output` (prefill), `past_*.{i}_RetainedState`.
The model code is `ref`'s; this module only flattens its inputs and outputs, picks the kernel
of each phase and routes each decoder layer through the ONNX function of its kind.
"""

from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from codegen.graphs import (
    Drawn,
    GraphError,
    GraphSpec,
    Released,
    Tensor,
    blocking,
    folded_rows,
    layer_function,
    route_layers,
    text_config,
)
from codegen.graphs.ccl import CCL, ccl_constraints, check_ccls, specializations
from codegen.graphs.decoder import (
    LM_HEAD,
    cache_owners,
    cache_tensors,
    decoder_kinds,
    gathered,
    model_sample,
    model_weights,
)
from ref import moe_modes
from ref.attention import blocked, reference
from ref.gemma4 import text as T
from ref.gemma4.kv_cache import ring_slots
from ref.gemma4.params import nested
from ref.gemma4.step import apply_step


def phase_blocking(mode, options, *, prefill, batch, queries, kv_len):
    """A phase's BlockingConfig (None = dense), see `codegen.graphs.blocking` (a prefill phase
    reads `q`, `kv`, `qkv`, `online` as the prefill modes, as `Gemma4.generate` does)."""
    config = blocking(mode, options, prefill=prefill, batch=batch, queries=queries, kv_len=kv_len)
    if prefill and config is not None and config.batch_fold:
        raise GraphError(
            "batch_fold is a decode layout (--decode-blocking kv_batch_fold); a prefill graph "
            "of such an export holds its cache folded too"
        )
    return config


def phase_moe(given, phase, cfg, *, num_cores, tokens):
    """A phase's MoE mode as text (`ref.moe_modes`): `given`, nsp's counts left out taking
    num_nsp = num_cores and packed_chunk 256 when it divides the step's `tokens` (batch ×
    seq_len), else all of them in one chunk; or, given None, what QEfficient compiles: decode
    gather, prefill nsp over num_cores when that divides the experts (dense otherwise, and
    without a MoE block). Whether the mode fits the graph, `model_graph` checks."""
    if given is None:
        if not cfg.enable_moe_block:
            return "dense"
        if phase == "decode":
            return "gather"
        if cfg.num_experts % num_cores:
            return "dense"
        given = "nsp"
    chunk = moe_modes.NSP_DEFAULTS["packed_chunk"]
    chunk = chunk if tokens % chunk == 0 else tokens
    try:
        return str(moe_modes.parse(given, num_nsp=num_cores, packed_chunk=chunk))
    except ValueError as e:
        raise GraphError(f"--moe-{phase} {given}: {e}") from e


def folds_cache(mode, options, *, batch, ctx_len):
    """True when decode blocking `mode`/`options` folds the batch into the KV heads
    (`kv_batch_fold`, or `batch_fold=true`): then both language graphs hold every cache as
    [1, rows·Hkv, T, D] (QEfficient's batch-fold layout, the same bytes as [rows, Hkv, T, D])."""
    config = blocking(mode, options, prefill=False, batch=batch, queries=1, kv_len=ctx_len)
    return config is not None and config.batch_fold


def model_graph(
    checkpoint_config,
    tensor_shapes,
    *,
    phase,
    mode=None,
    options=None,
    batch_size=1,
    seq_len,
    ctx_len,
    budgets=(),
    sliding_ring=True,
    full_batch_size=None,
    folded_cache=False,
    comp_ctx_lengths=(),
    moe="dense",
    drafts=0,
    use_functions=True,
):
    """The `prefill` (phase "prefill": seq_len tokens, vision merge, one specialization per
    vision budget) or `decode` graph (phase "decode": one token, no vision inputs).

    Traced at (batch_size, seq_len, ctx_len): block bounds are compile-time constants;
    `vision_size` stays symbolic. mode/options: the phase's blocking (see `phase_blocking`).
    full_batch_size: continuous batching (QEfficient's): the cache holds that many slots, both
    graphs take `batch_index` [batch_size, 1] (each row's slot), and decode runs over every
    slot (its batch_size is full_batch_size). folded_cache: every cache held batch-folded,
    [1, rows·Hkv, T, D] (`folds_cache`; a decode graph in `kv_batch_fold` holds it so
    always): each layer unfolds and folds its own cache (`ref.gemma4.kv_cache.unfolded`).
    comp_ctx_lengths: compute context lengths K (QEfficient's CCL): the graph takes an input
    `comp_ctx_lengths` [K] (int64, its length read only) and attends to the first K cache
    slots (`apply_step`'s key_len), one specialization per K (× vision budget); every
    position of a step must be < K (the runner picks the least K above them). moe: how the
    experts run (`ref.moe_modes` text; nsp's counts must divide the experts and batch × seq_len).
    """
    cfg, batch_size, seq_len = _checked_sizes(
        checkpoint_config, phase, batch_size, seq_len, ctx_len, full_batch_size
    )
    vision = phase == "prefill" and cfg.image_token_id is not None and bool(budgets)
    budgets = tuple(budgets) if vision else ()
    for budget in budgets:
        if not budget < ctx_len:
            raise GraphError(f"vision_size {budget} must be < ctx_len {ctx_len}")
    try:
        experts = moe_modes.for_phase(moe, phase, cfg.num_experts, batch_size * seq_len)
    except ValueError as e:
        raise GraphError(f"{phase} graph: {e}") from e
    config, multiple, ccls = planned_blocking(
        cfg, phase, mode, options, batch_size, seq_len, ctx_len, sliding_ring, comp_ctx_lengths,
        drafts,
    )  # fmt: skip
    folded = folded_cache or (config is not None and config.batch_fold)
    prefix, names = model_weights(cfg, tensor_shapes)
    kinds = decoder_kinds(cfg)
    rows = "batch_size" if full_batch_size is None else "full_batch_size"
    cache_in = cache_tensors(cfg, sliding_ring, ctx_len, rows, folded, drafts)
    ids, outputs = io_tensors(cfg, vision, full_batch_size is not None, bool(ccls), cache_in)
    forward = _forward(cfg, vision, ids, cache_in, names, prefix, kinds, experts)
    if use_functions:
        for kind in set(kinds):
            layer_function(kind)
    base = static_symbols(cfg, batch_size, seq_len, ctx_len, full_batch_size, folded)
    kernel = reference if config is None else partial(blocked, config=config)
    return GraphSpec(
        name=phase,
        kind=phase,
        options={
            **sized_options(mode, options, config, batch_size, seq_len, ctx_len),
            "budgets": list(budgets),
            "sliding_ring": sliding_ring,
            "full_batch_size": full_batch_size,
            "folded_cache": folded,
            "comp_ctx_lengths": list(ccls),
            "moe": str(experts),
            "drafts": drafts,
            "layer_functions": sorted(set(kinds)),
        },
        specializations=specializations(phase, base, budgets, ccls),
        static=tuple(base),
        constraints=ccl_constraints(ctx_len, multiple) if ccls else (),
        **step_fields(
            cfg,
            vision,
            (ids, cache_in, outputs),
            (prefix, names),
            forward(kernel, use_functions),
            forward,
        ),
    )


def step_fields(cfg, vision, io, weights, fn, forward):
    """The GraphSpec fields every language graph shares: its inputs (io: ids, caches, outputs),
    weights ((checkpoint prefix, names)), traced `fn`, `ref`'s answer through `forward`
    unrouted, sample inputs, retained-state pairs, gathered tables and the logits' head."""
    ids, cache_in, outputs = io
    prefix, names = weights
    return dict(
        inputs=ids + cache_in,
        outputs=outputs,
        weights=names,
        fn=fn,
        reference=traced_reference(forward, ids + cache_in, outputs, names),
        sample=partial(model_sample, cfg, vision, cache_in),
        retained=tuple((t.name, t.name + "_RetainedState") for t in cache_in),
        gathered=gathered(prefix, names),
        head=LM_HEAD if LM_HEAD in names else prefix + "embed_tokens.weight",
        # a layer's cache is read by that layer only (with continuous batching too: each
        # layer writes its slots' rows in place, `ref.gemma4.kv_cache.linear_memory`)
        lazy=tuple(t.name for t in cache_in),
    )


def _checked_sizes(checkpoint_config, phase, batch_size, seq_len, ctx_len, full_batch_size):
    """(text config, the graph's batch_size, its seq_len): decode runs over every
    continuous-batching slot, one token each; GraphError for a vision-only checkpoint, an
    unknown phase, or sizes that do not fit."""
    if full_batch_size is not None:
        if full_batch_size < batch_size:
            raise GraphError(
                f"full_batch_size {full_batch_size} must be >= batch_size {batch_size}"
            )
        if phase == "decode":
            batch_size = full_batch_size
    cfg = text_config(checkpoint_config)
    if cfg is None:
        raise GraphError("no text_config: a vision-only checkpoint has no language graphs")
    if phase not in ("prefill", "decode"):
        raise GraphError(f"phase {phase!r}: expected 'prefill' or 'decode'")
    if phase == "decode":
        seq_len = 1
    if seq_len > ctx_len:
        raise GraphError(f"seq_len {seq_len} must be <= ctx_len {ctx_len}")
    return cfg, batch_size, seq_len


def planned_blocking(
    cfg, phase, mode, options, batch_size, seq_len, ctx_len, sliding_ring, comp_ctx_lengths,
    drafts=0,
):  # fmt: skip
    """(the phase's BlockingConfig or None, the multiple its KV lengths must be, the checked
    compute context lengths), after planning the blocking at every KV length the graph
    attends over (each head count × ctx_len, each K, the ring's slots + seq_len)."""
    window = ring_slots(cfg.sliding_window, ctx_len, drafts)
    config = phase_blocking(
        mode,
        dict(options or {}),
        prefill=phase == "prefill",
        batch=batch_size,
        queries=seq_len,
        kv_len=min(ctx_len, window + seq_len) if sliding_ring else ctx_len,
    )
    multiple = 1 if config is None else config.kv_multiple(jax.local_device_count())
    ccls = check_ccls(comp_ctx_lengths, ctx_len, seq_len, phase, multiple)
    if config is not None:
        kv_lens = {ctx_len, *ccls} | ({window + seq_len} if sliding_ring else set())
        try:
            for kv_heads in sorted(set(cfg.kv_heads)):
                for kv_len in sorted(kv_lens):
                    config.plan(batch_size, cfg.num_attention_heads, kv_heads, seq_len, kv_len)
        except ValueError as e:
            raise GraphError(f"{phase} blocking {mode!r} {options}: {e}") from e
    return config, multiple, ccls


def io_tensors(cfg, vision, batch_index, ccl, cache_in):
    """(the inputs before the caches, the outputs): ids and positions, the soft tokens and
    image_idx (vision), batch_index (continuous batching), comp_ctx_lengths (ccl); logits,
    image_idx_output (vision), then each cache's retained state."""
    ids = (
        Tensor("input_ids", ("batch_size", "seq_len"), "int32"),
        Tensor("position_ids", ("batch_size", "seq_len"), "int32"),
    )
    if vision:
        ids += (
            Tensor("vision_embeds", ("batch_size", "vision_size", cfg.hidden_size), "float32"),
            Tensor("image_idx", ("batch_size", 1), "int32"),
        )
    if batch_index:
        ids += (Tensor("batch_index", ("batch_size", 1), "int32"),)
    if ccl:
        ids += (Tensor(CCL, (CCL,), "int64"),)
    outputs = (Tensor("logits", ("batch_size", 1, cfg.vocab_size), "float32"),)
    if vision:
        outputs += (Tensor("image_idx_output", ("batch_size", 1), "int32"),)
    outputs += tuple(Tensor(t.name + "_RetainedState", t.shape, t.dtype) for t in cache_in)
    return ids, outputs


def _forward(cfg, vision, ids, cache_in, names, prefix, kinds, experts):
    """forward(attention, routed): the graph's function of its flat arguments (`ids`, the
    caches, the weights `names`) to its flat outputs (logits, image_idx with vision, each
    owner's new key and value), one `apply_step` attending with `attention`, each decoder
    layer routed through the ONNX function of its kind when `routed`."""
    owners = cache_owners(cfg)
    n_in, n_text = len(ids), sum(n != LM_HEAD for n in names)

    def forward(attention, routed):
        def fn(*args):
            head, caches, weights = (
                args[:n_in],
                args[n_in : n_in + len(cache_in)],
                args[n_in + len(cache_in) :],
            )
            params = nested(names[:n_text], weights[:n_text], prefix)
            lm_head = weights[n_text] if len(weights) > n_text else None
            cache = {
                "k": {str(i): caches[2 * j] for j, i in enumerate(owners)},
                "v": {str(i): caches[2 * j + 1] for j, i in enumerate(owners)},
            }
            vision_args = head[2:4] if vision else (None, None)
            named = dict(zip((t.name for t in ids), head, strict=True))
            batch_index = named.get("batch_index")
            key_len = named[CCL].shape[0] if CCL in named else None
            kind = lambda module: kinds[module.layer]  # noqa: E731
            with nn.intercept_methods(route_layers(T.DecoderLayer, routed, kind)):
                out = apply_step(
                    params,
                    lm_head,
                    cache,
                    head[0],
                    head[1],
                    *vision_args,
                    batch_index,
                    config=cfg,
                    attention=attention,
                    last_only=True,
                    key_len=key_len,
                    moe=experts,
                )
            new = out["cache"]
            flat = [out["logits"]] + ([out["image_idx"]] if vision else [])
            for i in owners:
                flat += [new["k"][str(i)], new["v"][str(i)]]
            return tuple(flat)

        return fn

    return forward


def traced_reference(forward, inputs, outputs, names):
    """The GraphSpec's reference: `forward` unrouted on a sample feed of `inputs`."""

    def run_reference(feed, weights, attention=reference):
        """`ref` on the sample `feed` and float32 `weights`, attending with `attention`
        (a kernel with `reference`'s signature and answer)."""
        args = [feed[t.name] for t in inputs]
        args = [x if isinstance(x, Drawn) else jnp.asarray(x) for x in args]
        out = forward(attention, False)(
            *args, *(jnp.asarray(weights[n], jnp.float32) for n in names)
        )
        return {t.name: x if isinstance(x, Released) else np.asarray(x)
                for t, x in zip(outputs, out, strict=True)}  # fmt: skip

    return run_reference


def static_symbols(cfg, batch_size, seq_len, ctx_len, full_batch_size, folded):
    """The symbols bound at trace time: batch_size, seq_len, ctx_len, full_batch_size
    (continuous batching) and each folded cache's rows·Hkv (folded)."""
    base = {"batch_size": batch_size, "seq_len": seq_len, "ctx_len": ctx_len}
    if full_batch_size is not None:
        base["full_batch_size"] = full_batch_size
    for heads in set(cfg.kv_heads) if folded else ():
        base[folded_rows(cfg, heads)] = (full_batch_size or batch_size) * heads
    return base


def sized_options(mode, options, config, batch_size, seq_len, ctx_len):
    """The options a language graph records first: its blocking as asked and as resolved
    (`config`, None = dense), and its sizes."""
    return {
        "mode": mode or "none",
        "blocking": dict(options or {}),
        "resolved_blocking": None if config is None else config_json(config),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "ctx_len": ctx_len,
    }


def config_json(blocking):
    """A BlockingConfig's set fields, as the graph's options record them."""
    return {k: v for k, v in vars(blocking).items() if v not in (None, False)}
