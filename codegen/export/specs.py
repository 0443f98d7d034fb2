"""The graphs an export writes: the GraphSpecs a checkpoint and the export's options ask for,
each built through `codegen.graphs.kinds` (as `verify` rebuilds it from the manifest)."""

from codegen import graphs
from codegen.export.options import EXPORT_DEFAULTS, ExportError
from codegen.folder import paired
from codegen.graphs import attention as attention_graph
from codegen.graphs import audio as audio_graph
from codegen.graphs import decoder, kinds, unified
from codegen.graphs import language as language_graph
from codegen.graphs import model as model_graphs
from codegen.graphs import vision as vision_graph
from ref.blocking import VISION_TILES


def _speculate(decode, shared, opts, cfg):
    """The speculate graph's options: decode's (its blocking, cache layout and compute context
    lengths; its MoE mode at the round's rows × (K + 1) tokens), the drafts and the
    assistant's config."""
    asked = {k: v for k, v in decode.items() if k != "budgets"}
    rows = opts.full_batch_size or opts.batch_size
    asked["moe"] = model_graphs.phase_moe(opts.moe_decode, "decode", cfg, num_cores=opts.num_cores,
                                          tokens=rows * (decode["drafts"] + 1))  # fmt: skip
    return {**asked, "batch_size": shared["batch_size"], "ctx_len": shared["ctx_len"],
            "assistant": paired.assistant_options(opts.assistant)}  # fmt: skip


def _embedders(config, opts, build, wants_vision):
    """Gemma 4 12B Unified's embedder graphs in place of the towers (`codegen.graphs.unified`);
    the towers' own options refused."""
    if tuple(opts.vision_tiles) != VISION_TILES:
        raise ExportError(
            f"--vision-tiles {opts.vision_tiles}: gemma4_unified has no vision tower (its "
            "vision embedder attends nowhere); leave the option out"
        )
    if opts.audio_clips != EXPORT_DEFAULTS["audio_clips"]:
        raise ExportError(
            f"--audio-clips {opts.audio_clips}: gemma4_unified has no audio tower (its frames "
            "are embedded one by one); leave the option out"
        )
    specs = []
    if opts.budgets and wants_vision and config.get("vision_config") is not None:
        specs.append(build("embed_vision", "vision", {"budgets": list(opts.budgets)}))
    if opts.audio_budgets and wants_vision and config.get("audio_config") is not None:
        specs.append(build("embed_audio", "audio", {"budgets": list(opts.audio_budgets)}))
    return specs


def _language_options(opts, cfg, folded, drafts):
    """{phase: the options of its language graph}: its blocking, cache layout, compute context
    lengths and MoE mode (the step's tokens: decode runs over every continuous-batching slot)."""
    out = {}
    for phase, (mode, options), moe in (
        ("prefill", opts.prefill_blocking, opts.moe_prefill),
        ("decode", opts.decode_blocking, opts.moe_decode),
    ):
        decode_rows = opts.full_batch_size or opts.batch_size
        tokens = opts.batch_size * opts.seq_len if phase == "prefill" else decode_rows
        out[phase] = {
            "mode": mode,
            "blocking": options,
            "budgets": opts.budgets,
            "sliding_ring": opts.sliding_ring,
            "full_batch_size": opts.full_batch_size,
            "folded_cache": folded,
            "comp_ctx_lengths": list(opts.ccl_lists()[phase]),
            "moe": model_graphs.phase_moe(moe, phase, cfg, num_cores=opts.num_cores, tokens=tokens),
            "drafts": drafts,
        }
    return out


def one_program(opts, asked, folded):
    """None when prefill and decode are exported as one `language` program; else why they
    are two (`--split-programs`, a one-phase export, or a mode pair one graph cannot hold:
    `codegen.graphs.language.one_program_refusal`)."""
    if opts.split_programs:
        return "--split-programs"
    if set(opts.phases) != {"prefill", "decode"}:
        return f"--{opts.phases[0]}-only"
    p, d = asked["prefill"], asked["decode"]
    return language_graph.one_program_refusal(
        (p["mode"], p["blocking"]), (d["mode"], d["blocking"]), p["moe"], d["moe"], folded
    )


def graph_specs(checkpoint, opts):
    """The GraphSpecs this checkpoint and these options ask for: the vision tower (when the
    checkpoint has one), the audio tower and embed_audio (when it has an audio_config and
    their tensors), then the language model: one `language` program where prefill and decode
    can be one graph (`one_program`), else its prefill and decode graphs (`--graphs
    model`, when it has a text decoder) and/or the attention stacks (`--graphs attention`)."""
    shapes = {n: info.shape for n, info in checkpoint.tensors.items()}
    shared = {"batch_size": opts.batch_size, "seq_len": opts.seq_len, "ctx_len": opts.ctx_len}

    def build(kind, name, options):
        return kinds.build(kind, name, checkpoint.config, shapes, options,
                           use_functions=opts.sub_functions)  # fmt: skip

    language = "model" in opts.graphs and decoder.text_prefix(shapes) is not None
    language = language and graphs.text_config(checkpoint.config) is not None
    specs = []
    # a --decode-only export reads no image: its vision graph belongs to the prefill side
    wants_vision = not language or "prefill" in opts.phases
    if unified.is_unified(checkpoint.config):
        specs += _embedders(checkpoint.config, opts, build, wants_vision)
    elif opts.budgets and wants_vision and vision_graph.vision_prefix(shapes) is not None:
        # vision_size < ctx_len binds only where a language graph reads the soft tokens
        vision_graph.check_budgets(opts.budgets, opts.ctx_len if language else None)
        asked = {"budgets": opts.budgets, "tiles": opts.vision_tiles}
        specs.append(build("vision", "vision", asked))
    # the audio tower, like vision, on the prefill side; its soft tokens ride vision_embeds
    if opts.audio_budgets and wants_vision and audio_graph.has_audio(checkpoint.config, shapes):
        asked = {"budgets": list(opts.audio_budgets), "clips": opts.audio_clips}
        specs.append(build("audio", "audio", asked))
    if language:
        # both sides hold the cache as the decode graph reads it (the retained state)
        folded = model_graphs.folds_cache(
            *opts.decode_blocking, batch=opts.full_batch_size or opts.batch_size,
            ctx_len=opts.ctx_len,
        )  # fmt: skip
        cfg = graphs.text_config(checkpoint.config)
        drafts = opts.drafts()
        asked = _language_options(opts, cfg, folded, drafts)
        split = one_program(opts, asked, folded)  # None: one program
        if split is None:
            language = {**shared, **asked["prefill"],
                        "decode_comp_ctx_lengths": asked["decode"]["comp_ctx_lengths"]}  # fmt: skip
            specs.append(build("language", "language", language))
        for phase in ("prefill", "decode"):
            if phase in opts.phases and split is not None:
                specs.append(build(phase, phase, {**shared, **asked[phase]}))
        if "decode" in opts.phases and drafts:
            speculate = _speculate(asked["decode"], shared, opts, cfg)
            specs.append(build("speculate", "speculate", speculate))
    stackable = "attention" in opts.graphs and attention_graph.attention_layers_available(
        checkpoint.config, shapes
    )
    seen = {}
    for mode, options in opts.blocking if stackable else ():
        seen[mode] = seen.get(mode, 0) + 1
        name = f"attention_{mode}" + (f"_{seen[mode]}" if seen[mode] > 1 else "")
        asked = {"mode": mode, "blocking": options, "layers": opts.attention_layers or stackable}
        specs.append(build("attention", name, {**shared, **asked}))
    if not specs:
        raise ExportError(
            f"{checkpoint.dir}: nothing to export (no vision tower tensors, no text decoder "
            f"for --graphs model, no stackable attention layers for --graphs attention)"
        )
    return specs
