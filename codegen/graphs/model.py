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
from ref import moe_modes
from ref.attention import blocked, reference
from ref.gemma4 import text as T
from ref.gemma4.params import TEXT, nested, text_param_shapes
from ref.gemma4.step import apply_step
from ref.gemma4.text_config import SLIDING
from weights import check_shapes

LM_HEAD = "lm_head.weight"
CCL = "comp_ctx_lengths"  # QEfficient's input and symbol: the graph reads its length only
TEXT_PREFIXES = (TEXT, "model.")


def text_prefix(tensor_names):
    """Where the decoder's names start ("model.language_model." in a Gemma 4 VLM, "model."
    in a text-only Gemma4ForCausalLM save), None without a decoder."""
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in tensor_names:
            return prefix
    return None


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


def decoder_kinds(cfg):
    """The ONNX function name of each decoder layer: one per distinct layer structure
    (sliding/full × owns its cache or shares one × dense/MoE, then head layout)."""
    names, seen = [], {}
    for i in range(cfg.num_hidden_layers):
        base = "Sliding" if cfg.layer_types[i] == SLIDING else "Full"
        base += "Shared" if cfg.shares_kv(i) else ""
        base += "MoE" if cfg.enable_moe_block else ""
        shape = (cfg.head_dims[i], cfg.kv_heads[i])
        layouts = seen.setdefault(base, [])
        if shape not in layouts:
            layouts.append(shape)
        n = layouts.index(shape)
        names.append(f"{base}DecoderLayer" + (f"_{n + 1}" if n else ""))
    return tuple(names)


def cache_owners(cfg):
    """The layers that own a KV cache (KV-sharing consumers read their producer's)."""
    return [i for i in range(cfg.num_hidden_layers) if not cfg.shares_kv(i)]


def _cache_tensors(cfg, ring, ctx_len, rows="batch_size", folded=False):
    window = min(cfg.sliding_window, ctx_len)
    out = []
    for i in cache_owners(cfg):
        slots = window if ring and cfg.layer_types[i] == SLIDING else "ctx_len"
        lead = (1, folded_rows(cfg, cfg.kv_heads[i])) if folded else (rows, cfg.kv_heads[i])
        shape = (*lead, slots, cfg.head_dims[i])
        out += [Tensor(f"past_{kind}.{i}", shape, "float32") for kind in ("key", "value")]
    return tuple(out)


def model_weights(cfg, tensor_shapes):
    """(checkpoint prefix, weight names in call order: the decoder's, then lm_head if the
    checkpoint has its own), after checking every shape against `ref`."""
    prefix = text_prefix(tensor_shapes)
    if prefix is None:
        raise GraphError(f"no text decoder: missing tensor '{TEXT}embed_tokens.weight'")
    expected = {prefix + n[len(TEXT) :]: s for n, s in text_param_shapes(cfg).items()}
    if LM_HEAD in tensor_shapes:
        expected[LM_HEAD] = (cfg.vocab_size, cfg.hidden_size)
    check_shapes(tensor_shapes, expected, "checkpoint")
    names = sorted(n for n in expected if n != LM_HEAD)
    return prefix, tuple(names) + ((LM_HEAD,) if LM_HEAD in expected else ())


def _sample(cfg, vision, cache_in, symbols, rng):
    """Random inputs: per row positions from a random start with a padded tail (below the
    compute context length with one), text ids with a run of image tokens (prefill), random
    soft tokens, image_idx and caches (`Drawn`)."""
    b, s = symbols["batch_size"], symbols["seq_len"]
    t = symbols.get(CCL, symbols["ctx_len"])
    start = rng.integers(0, t - s + 1, (b, 1))
    pos = (start + np.arange(s)[None, :]).astype(np.int32)
    pad = rng.integers(0, s // 2 + 1, b) if s > 1 else np.zeros(b, int)
    pos[np.arange(s)[None, :] >= (s - pad)[:, None]] = -1
    special = {cfg.image_token_id, cfg.pad_token_id}
    ids = rng.integers(0, cfg.vocab_size, (b, s)).astype(np.int32)
    ids[np.isin(ids, list(special - {None}))] = (cfg.pad_token_id + 1) % cfg.vocab_size
    feed = {"input_ids": ids, "position_ids": pos}
    if vision:
        v = symbols["vision_size"]
        image_idx = np.zeros((b, 1), np.int32)
        for r in range(b):
            lo = int(rng.integers(0, s))
            hi = int(rng.integers(lo, min(s, lo + v) + 1))
            ids[r, lo:hi] = cfg.image_token_id
            image_idx[r, 0] = rng.integers(0, v - (hi - lo) + 1)
        feed["vision_embeds"] = rng.standard_normal((b, v, cfg.hidden_size), dtype=np.float32)
        feed["image_idx"] = image_idx
    if CCL in symbols:
        feed[CCL] = np.zeros(symbols[CCL], np.int64)  # its length is what the graph reads
    if "full_batch_size" in symbols:
        slots = rng.permutation(symbols["full_batch_size"])[:b].astype(np.int32)
        feed["batch_index"] = slots[:, None]
    for tensor in cache_in:
        feed[tensor.name] = Drawn(tensor.concrete(symbols), tuple(rng.integers(0, 2**63, 2)))
    return feed


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
    prefill = phase == "prefill"
    if not prefill:
        seq_len = 1
    if seq_len > ctx_len:
        raise GraphError(f"seq_len {seq_len} must be <= ctx_len {ctx_len}")
    vision = prefill and cfg.image_token_id is not None and bool(budgets)
    for budget in budgets if vision else ():
        if not budget < ctx_len:
            raise GraphError(f"vision_size {budget} must be < ctx_len {ctx_len}")
    try:
        experts = moe_modes.for_phase(moe, phase, cfg.num_experts, batch_size * seq_len)
    except ValueError as e:
        raise GraphError(f"{phase} graph: {e}") from e
    window = min(cfg.sliding_window, ctx_len)
    config = phase_blocking(
        mode,
        dict(options or {}),
        prefill=prefill,
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
    folded = folded_cache or (config is not None and config.batch_fold)
    prefix, names = model_weights(cfg, tensor_shapes)
    kernel = reference if config is None else partial(blocked, config=config)
    kinds = decoder_kinds(cfg)

    ids = (
        Tensor("input_ids", ("batch_size", "seq_len"), "int32"),
        Tensor("position_ids", ("batch_size", "seq_len"), "int32"),
    )
    if vision:
        ids += (
            Tensor("vision_embeds", ("batch_size", "vision_size", cfg.hidden_size), "float32"),
            Tensor("image_idx", ("batch_size", 1), "int32"),
        )
    if full_batch_size is not None:
        ids += (Tensor("batch_index", ("batch_size", 1), "int32"),)
    if ccls:
        ids += (Tensor(CCL, (CCL,), "int64"),)
    rows = "batch_size" if full_batch_size is None else "full_batch_size"
    cache_in = _cache_tensors(cfg, sliding_ring, ctx_len, rows, folded)
    outputs = (Tensor("logits", ("batch_size", 1, cfg.vocab_size), "float32"),)
    if vision:
        outputs += (Tensor("image_idx_output", ("batch_size", 1), "int32"),)
    outputs += tuple(Tensor(t.name + "_RetainedState", t.shape, t.dtype) for t in cache_in)
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
            key_len = named[CCL].shape[0] if ccls else None
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

    if use_functions:
        for kind in set(kinds):
            layer_function(kind)

    def run_reference(feed, weights, attention=reference):
        """`ref` on the sample `feed` and float32 `weights`, attending with `attention`
        (a kernel with `reference`'s signature and answer)."""
        args = [feed[t.name] for t in ids + cache_in]
        args = [x if isinstance(x, Drawn) else jnp.asarray(x) for x in args]
        out = forward(attention, False)(
            *args, *(jnp.asarray(weights[n], jnp.float32) for n in names)
        )
        return {t.name: x if isinstance(x, Released) else np.asarray(x)
                for t, x in zip(outputs, out, strict=True)}  # fmt: skip

    base = {"batch_size": batch_size, "seq_len": seq_len, "ctx_len": ctx_len}
    if full_batch_size is not None:
        base["full_batch_size"] = full_batch_size
    for heads in set(cfg.kv_heads) if folded else ():
        base[folded_rows(cfg, heads)] = (full_batch_size or batch_size) * heads
    specs = _specializations(phase, base, budgets if vision else (), ccls)
    return GraphSpec(
        name=phase,
        kind=phase,
        options={
            "mode": mode or "none",
            "blocking": dict(options or {}),
            "resolved_blocking": None if config is None else _config_json(config),
            "batch_size": batch_size,
            "seq_len": seq_len,
            "ctx_len": ctx_len,
            "budgets": list(budgets) if vision else [],
            "sliding_ring": sliding_ring,
            "full_batch_size": full_batch_size,
            "folded_cache": folded,
            "comp_ctx_lengths": list(ccls),
            "moe": str(experts),
            "layer_functions": sorted(set(kinds)),
        },
        inputs=ids + cache_in,
        outputs=outputs,
        weights=names,
        fn=forward(kernel, use_functions),
        reference=run_reference,
        sample=partial(_sample, cfg, vision, cache_in),
        specializations=specs,
        retained=tuple((t.name, t.name + "_RetainedState") for t in cache_in),
        static=tuple(base),
        gathered=_gathered(prefix, names),
        head=LM_HEAD if LM_HEAD in names else prefix + "embed_tokens.weight",
        # a layer's cache is read by that layer only (with continuous batching too: each
        # layer writes its slots' rows in place, `ref.gemma4.kv_cache.linear_memory`)
        lazy=tuple(t.name for t in cache_in),
        constraints=_ccl_constraints(ctx_len, multiple) if ccls else (),
    )


def _ccl_constraints(ctx_len, multiple):
    """What the trace may assume of the symbol comp_ctx_lengths (`check_ccls` holds them)."""
    out = (f"{CCL} <= {ctx_len}", f"{CCL} >= {multiple}")
    return out + ((f"mod({CCL}, {multiple}) == 0",) if multiple > 1 else ())


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


def _specializations(phase, base, budgets, ccls):
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


def _gathered(prefix, names):
    """The tables `ref` only gathers rows of: per-layer embeddings, and the token embeddings
    when the checkpoint has its own lm_head (else they are the logits' weights too)."""
    tables = [prefix + "embed_tokens_per_layer.weight"]
    if LM_HEAD in names:
        tables.append(prefix + "embed_tokens.weight")
    return tuple(n for n in tables if n in names)


def _config_json(blocking):
    return {k: v for k, v in vars(blocking).items() if v not in (None, False)}
