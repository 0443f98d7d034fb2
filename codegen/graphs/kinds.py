"""The graph kinds, in one place: each kind's builder called with the options a graph records
(`GraphSpec.options`, the manifest entry's "options"). `export.graph_specs` builds every graph
through `build` from the options it asks for, and `verify` rebuilds each graph of a folder
from its manifest entry through the same call, so the two cannot drift apart. Options an
older export did not record get their old meaning when its manifest is read
(`codegen.folder.manifest`).
"""

from codegen.graphs import attention as attention_graph
from codegen.graphs import audio as audio_graph
from codegen.graphs import language as language_graph
from codegen.graphs import model as model_graphs
from codegen.graphs import speculate as speculate_graph
from codegen.graphs import unified as unified_graphs
from codegen.graphs import vision as vision_graph


def _vision(config, shapes, name, o, use_functions):
    return vision_graph.vision_graph(
        config, shapes, o["budgets"], use_functions=use_functions, tiles=tuple(o["tiles"])
    )


def _audio(config, shapes, name, o, use_functions):
    return audio_graph.audio_graph(
        config, shapes, tuple(o["budgets"]), o["clips"], use_functions=use_functions
    )


def _embed_vision(config, shapes, name, o, use_functions):
    return unified_graphs.embed_vision_graph(config, shapes, o["budgets"],
                                             use_functions=use_functions)  # fmt: skip


def _embed_audio(config, shapes, name, o, use_functions):
    return unified_graphs.embed_audio_graph(config, shapes, o["budgets"],
                                            use_functions=use_functions)  # fmt: skip


def _shared(o, use_functions):
    """The keyword arguments the language and attention builders share."""
    keys = ("batch_size", "seq_len", "ctx_len")
    return dict(mode=o["mode"], options=o["blocking"], use_functions=use_functions,
                **{k: o[k] for k in keys})  # fmt: skip


def _language(config, shapes, name, o, use_functions):
    return model_graphs.model_graph(
        config, shapes, phase=name, budgets=o["budgets"], sliding_ring=o["sliding_ring"],
        full_batch_size=o["full_batch_size"], folded_cache=o["folded_cache"],
        comp_ctx_lengths=tuple(o["comp_ctx_lengths"]), moe=o["moe"], drafts=o["drafts"],
        **_shared(o, use_functions),
    )  # fmt: skip


def _one_program(config, shapes, name, o, use_functions):
    keys = ("batch_size", "seq_len", "ctx_len", "sliding_ring", "full_batch_size", "moe",
            "drafts")  # fmt: skip
    return language_graph.language_graph(
        config, shapes, budgets=o["budgets"], comp_ctx_lengths=tuple(o["comp_ctx_lengths"]),
        decode_comp_ctx_lengths=tuple(o["decode_comp_ctx_lengths"]),
        use_functions=use_functions, **{k: o[k] for k in keys},
    )  # fmt: skip


def _speculate(config, shapes, name, o, use_functions):
    keys = ("mode", "batch_size", "ctx_len", "sliding_ring", "full_batch_size", "folded_cache",
            "moe", "drafts", "assistant")  # fmt: skip
    return speculate_graph.speculate_graph(
        config, shapes, options=o["blocking"], comp_ctx_lengths=tuple(o["comp_ctx_lengths"]),
        use_functions=use_functions, **{k: o[k] for k in keys},
    )  # fmt: skip


def _attention(config, shapes, name, o, use_functions):
    return attention_graph.attention_graph(
        config, shapes, name=name, layers=o["layers"], **_shared(o, use_functions)
    )


# kind → builder(checkpoint config, {tensor: shape}, graph name, options, use_functions)
BUILDERS = {
    "vision": _vision,
    "audio": _audio,
    "embed_vision": _embed_vision,
    "embed_audio": _embed_audio,
    "prefill": _language,
    "decode": _language,
    "language": _one_program,
    "speculate": _speculate,
    "attention": _attention,
}


class KindError(ValueError):
    """A graph kind no builder knows."""


def build(kind, name, config, shapes, options, *, use_functions):
    """The GraphSpec of graph `name` of `kind` from its options (a manifest entry's, or what
    `export.graph_specs` asks for). shapes: {checkpoint tensor name: shape}."""
    builder = BUILDERS.get(kind)
    if builder is None:
        raise KindError(f"graph {name!r} has unknown kind {kind!r} (known: {', '.join(BUILDERS)})")
    return builder(config, shapes, name, options, use_functions)
