"""The `speculate` graph: one round of greedy speculative decoding with Gemma 4's MTP assistant
as one QAIC call (`ref.gemma4.speculative.device_round`).

On QAIC a program's retained state is its own, so the drafter lives in the program that holds
the target's KV cache: the call verifies the round's K drafts (the target's step over
[t, d_1 … d_K] at P … P + K), accepts the leading drafts the target agrees with (ArgMax of the
first disagreement), and drafts the next round's K tokens from the accepted one, the drafter
reading the target's shared layers' keys where the cache holds them. No cache and no hidden
state leaves the call: the host reads the emitted tokens, the accepted counts and the next
drafts. I/O: decode's (`input_ids`, `position_ids` [rows, K + 1], `batch_index` with
continuous batching, `comp_ctx_lengths` with compute context lengths, the caches) →
`tokens` [rows, K + 1] (−1 after a row's last), `accepted` [rows], `drafts` [rows, K], each
cache's `_RetainedState`.

Weights: the target's decoder and head, then the drafter's under `assistant.` (the export's
`assistant/` folder, `codegen.folder.paired`). Each target layer runs through the ONNX
function of its kind (`decoder.decoder_kinds`), each drafter layer through one of its own
(`Assistant…`), called K times.
"""

from functools import partial

import flax.linen as nn
import numpy as np

from codegen.graphs import GraphError, GraphSpec, Tensor, layer_function, route_layers, text_config
from codegen.graphs.ccl import CCL, ccl_constraints, specializations
from codegen.graphs.decoder import (
    LM_HEAD,
    cache_owners,
    cache_tensors,
    decoder_kinds,
    gathered,
    model_sample,
)
from codegen.graphs.decoder import model_weights as target_weights
from codegen.graphs.model import (
    io_tensors,
    planned_blocking,
    sized_options,
    static_symbols,
    traced_reference,
)
from ref import moe_modes
from ref.attention import blocked, reference
from ref.gemma4 import text as T
from ref.gemma4.assistant import AssistantConfig, param_shapes
from ref.gemma4.params import nested
from ref.gemma4.speculative import check_pair, device_round
from weights import check_shapes

PREFIX = "assistant."  # the graph's names of the drafter's tensors (`codegen.folder.paired`)
DRAFTER = "Assistant"  # the drafter's layer functions are named DRAFTER + their kind


def drafter(assistant):
    """The `AssistantConfig` of {"config", "generation_config"} (`paired.assistant_options`)."""
    try:
        return AssistantConfig.from_hf(assistant["config"], assistant.get("generation_config"))
    except ValueError as e:
        raise GraphError(f"assistant: {e}") from e


def _drafter_weights(config, tensor_shapes):
    """The drafter's weight names in the graph (`PREFIX` + checkpoint name), shapes checked."""
    expected = {PREFIX + n: s for n, s in param_shapes(config).items()}
    check_shapes(tensor_shapes, expected, "assistant checkpoint")
    return tuple(sorted(expected))


def speculate_graph(
    checkpoint_config,
    tensor_shapes,
    *,
    assistant,
    drafts,
    mode=None,
    options=None,
    batch_size=1,
    ctx_len,
    sliding_ring=True,
    full_batch_size=None,
    folded_cache=False,
    comp_ctx_lengths=(),
    moe="dense",
    use_functions=True,
):
    """The `speculate` graph of K = `drafts` draft tokens (seq_len K + 1) over every row of the
    cache (full_batch_size slots with continuous batching, as decode). assistant: {"config",
    "generation_config"} of the drafter's checkpoint; mode/options: the decode blocking (the
    target's step; the drafter attends densely); the rest as `model.model_graph`'s decode."""
    cfg = text_config(checkpoint_config)
    if cfg is None:
        raise GraphError("no text_config: a vision-only checkpoint cannot speculate")
    if isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1:
        raise GraphError(f"num_speculative_tokens={drafts!r}: expected an int >= 1")
    acfg = drafter(assistant)
    try:
        check_pair(cfg, acfg)
    except ValueError as e:
        raise GraphError(str(e)) from e
    rows = batch_size if full_batch_size is None else full_batch_size
    seq_len = drafts + 1
    if seq_len > ctx_len:
        raise GraphError(f"num_speculative_tokens + 1 = {seq_len} must be <= ctx_len {ctx_len}")
    try:
        experts = moe_modes.for_phase(moe, "decode", cfg.num_experts, rows * seq_len)
    except ValueError as e:
        raise GraphError(f"speculate graph: {e}") from e
    config, multiple, ccls = planned_blocking(cfg, "decode", mode, options, rows, seq_len, ctx_len,
                                              sliding_ring, comp_ctx_lengths, drafts)  # fmt: skip
    folded = folded_cache or (config is not None and config.batch_fold)
    prefix, names = target_weights(cfg, tensor_shapes)
    mine = _drafter_weights(acfg, tensor_shapes)
    slots = "batch_size" if full_batch_size is None else "full_batch_size"
    cache_in = cache_tensors(cfg, sliding_ring, ctx_len, slots, folded, drafts)
    ids, _ = io_tensors(cfg, False, full_batch_size is not None, bool(ccls), cache_in)  # decode's
    outputs = (
        Tensor("tokens", ("batch_size", "seq_len"), "int32"),
        Tensor("accepted", ("batch_size",), "int32"),
        Tensor("drafts", ("batch_size", drafts), "int32"),
    ) + tuple(Tensor(t.name + "_RetainedState", t.shape, t.dtype) for t in cache_in)
    kinds = decoder_kinds(cfg)
    own = tuple(DRAFTER + k for k in decoder_kinds(acfg.text))
    forward = _forward(cfg, acfg, ids, cache_in, names, mine, prefix, (kinds, own), experts)
    if use_functions:
        for kind in set(kinds) | set(own):
            layer_function(kind)
    base = static_symbols(cfg, rows, seq_len, ctx_len, full_batch_size, folded)
    kernel = reference if config is None else partial(blocked, config=config)
    return GraphSpec(
        name="speculate",
        kind="speculate",
        options={
            **sized_options(mode, options, config, batch_size, seq_len, ctx_len),
            "drafts": drafts,
            "assistant": assistant,
            "sliding_ring": sliding_ring,
            "full_batch_size": full_batch_size,
            "folded_cache": folded,
            "comp_ctx_lengths": list(ccls),
            "moe": str(experts),
            "layer_functions": sorted(set(kinds) | set(own)),
        },
        inputs=ids + cache_in,
        outputs=outputs,
        weights=names + mine,
        fn=forward(kernel, use_functions),
        reference=traced_reference(forward, ids + cache_in, outputs, names + mine),
        sample=partial(_sample, cfg, drafts, cache_in),
        specializations=specializations("speculate", base, (), ccls),
        retained=tuple((t.name, t.name + "_RetainedState") for t in cache_in),
        static=tuple(base),
        gathered=gathered(prefix, names),
        head=LM_HEAD if LM_HEAD in names else prefix + "embed_tokens.weight",
        other_heads=(PREFIX + ("model.embed_tokens.weight" if acfg.tied else "lm_head.weight"),),
        lazy=tuple(t.name for t in cache_in),
        constraints=ccl_constraints(ctx_len, multiple) if ccls else (),
    )


def _sample(cfg, drafts, cache_in, symbols, rng):
    """Decode's random inputs at K + 1 tokens a row, a row's positions never padded in the
    middle (a round's are P … P + K, or all −1 for a row without a request)."""
    feed = model_sample(cfg, False, cache_in, symbols, rng)
    pos = feed["position_ids"]
    pos[:] = np.where(pos[:, :1] >= 0, pos[:, :1] + np.arange(drafts + 1), -1)
    return feed


def _forward(cfg, acfg, ids, cache_in, names, mine, prefix, kinds, experts):
    """forward(attention, routed): the graph's function of its flat arguments (`ids`, the
    caches, the target's weights `names`, the drafter's `mine`) → (tokens, accepted, drafts,
    each owner's new key and value): one `device_round`, each decoder layer (the target's and
    the drafter's) routed through the ONNX function of its kind when `routed`."""
    owners = cache_owners(cfg)
    n_in, n_cache, n_text = len(ids), len(cache_in), sum(n != LM_HEAD for n in names)
    target_kinds, own_kinds = kinds

    def kind(module):
        return (own_kinds if module.config == acfg.text else target_kinds)[module.layer]

    def forward(attention, routed):
        def fn(*args):
            head, caches = args[:n_in], args[n_in : n_in + n_cache]
            weights = args[n_in + n_cache :]
            params = nested(names[:n_text], weights[:n_text], prefix)
            lm_head = weights[n_text] if len(names) > n_text else None
            theirs = nested(mine, weights[len(names) :], PREFIX)
            cache = {
                "k": {str(i): caches[2 * j] for j, i in enumerate(owners)},
                "v": {str(i): caches[2 * j + 1] for j, i in enumerate(owners)},
            }
            named = dict(zip((t.name for t in ids), head, strict=True))
            key_len = named[CCL].shape[0] if CCL in named else None
            with nn.intercept_methods(route_layers(T.DecoderLayer, routed, kind)):
                out = device_round(params, lm_head, theirs, cache, named["input_ids"],
                                   named["position_ids"], named.get("batch_index"), config=cfg,
                                   assistant=acfg, attention=attention, moe=experts,
                                   key_len=key_len)  # fmt: skip
            flat = [out["tokens"], out["accepted"], out["drafts"]]
            for i in owners:
                flat += [out["cache"]["k"][str(i)], out["cache"]["v"][str(i)]]
            return tuple(flat)

        return fn

    return forward
