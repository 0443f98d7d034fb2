"""The `audio` graph: the packed Gemma 4 audio tower then embed_audio (`ref.gemma4.audio_tower.
audio_apply`) over `num_frames` log-mel frames of up to `clips` clips, one specialization per
soft-token budget.

A budget of T soft tokens is T · 4 frames (two stride-2 convolutions), 40 ms a token: 188 ≈ 7.5 s,
750 = 30 s (the processor's limit, `MAX_SOFT_TOKENS`). The packing's index arrays
(`ref.gemma4.audio_packing.pack` with frame_budget 4T and max_clips `clips`) are inputs, so one
graph runs any clips whose frames fit; their sizes (`budgets`) are the specialization's symbols.
`audio_size` soft tokens come out: each clip's at its `cu_tokens`, filler rows after them.
"""

import jax
import jax.numpy as jnp
import numpy as np

from codegen.graphs import GraphError, GraphSpec, Tensor, eager_reference, route_layers
from ref.gemma4 import audio as A
from ref.gemma4.audio_config import AudioConfig
from ref.gemma4.audio_features import MAX_SOFT_TOKENS, MEL_BINS
from ref.gemma4.audio_packing import budgets as packing_budgets
from ref.gemma4.audio_packing import pack
from ref.gemma4.audio_tower import AUDIO, audio_apply
from ref.gemma4.params import dotted, nested
from weights import check_shapes

EMBED_AUDIO = "model.embed_audio."
FRAMES_PER_TOKEN = 4
# the packing's index arrays (`AudioPacking.arrays`), in input order
_INDEX = ("first_taps", "second_taps", "chunk_queries", "chunk_keys", "token_slots",
          "causal_taps")  # fmt: skip


def has_audio(checkpoint_config, tensor_names):
    """Whether the checkpoint holds an audio tower and embed_audio the graph can take."""
    return (
        checkpoint_config.get("audio_config") is not None
        and AUDIO + "output_proj.weight" in tensor_names
        and EMBED_AUDIO + "embedding_projection.weight" in tensor_names
    )


def audio_param_shapes(cfg):
    """{checkpoint name: shape} of the tower and embed_audio (no bytes read)."""
    p = pack([4], cfg)
    frames = jnp.zeros((4, MEL_BINS), jnp.float32)
    tree = jax.eval_shape(
        lambda: A.AudioModel(cfg, False).init(jax.random.PRNGKey(0), frames, p.arrays)
    )["params"]
    shapes = {n: tuple(s.shape) for n, s in dotted(tree, AUDIO).items()}
    shapes[EMBED_AUDIO + "embedding_projection.weight"] = (
        cfg.text_hidden_size,
        cfg.output_proj_dims,
    )
    return shapes


def _symbols(cfg, budget, clips):
    frames = FRAMES_PER_TOKEN * budget
    rows, tokens, chunks = packing_budgets(frames, clips, cfg.attention_chunk_size)
    return {"num_frames": frames, "audio_rows": rows, "audio_size": tokens, "audio_chunks": chunks}


def _AUDIO_LAYER(module):
    return "AudioLayer"


def _audio_forward(cfg, names, use_functions):
    """fn(frames, *index arrays, *weights) → (audio_embeds,)."""

    def fn(frames, *arrays):
        index = dict(zip(_INDEX, arrays[: len(_INDEX)], strict=True))
        params = nested(names, arrays[len(_INDEX) :])
        with A.nn.intercept_methods(route_layers(A.ConformerLayer, use_functions, _AUDIO_LAYER)):
            out = audio_apply(
                params["model"]["audio_tower"],
                params["model"]["embed_audio"],
                frames,
                index,
                config=cfg,
                keep_states=False,
            )
        return (out["embeds"],)

    return fn


def _audio_sample(cfg, clips):
    def sample(symbols, rng):
        """Random clips (1 to `clips` of them, of any lengths) whose frames fill at most
        `num_frames`, packed; frames standard normal."""
        n = symbols["num_frames"]
        count = int(rng.integers(1, clips + 1))
        cuts = np.sort(rng.integers(0, n + 1, count - 1)) if count > 1 else np.zeros(0, int)
        used = int(rng.integers(count, n + 1))
        counts = np.diff(np.concatenate([[0], np.minimum(cuts, used), [used]]))
        counts = [max(int(c), 1) for c in counts]
        while sum(counts) > n:
            counts[int(np.argmax(counts))] -= 1
        packing = pack(counts, cfg, frame_budget=n, max_clips=clips)
        feed = {"frames": rng.standard_normal((n, MEL_BINS), dtype=np.float32)}
        return feed | dict(packing.arrays)

    return sample


def audio_graph(checkpoint_config, tensor_shapes, budgets, clips, *, use_functions=True):
    """The packed audio tower and embed_audio over `num_frames` frames of ≤ `clips` clips.

    tensor_shapes: {checkpoint name: shape}; budgets: soft tokens per call, one specialization
    each (`num_frames` = 4 · budget); clips: the most clips one call packs.
    """
    if checkpoint_config.get("audio_config") is None:
        raise GraphError("no audio tower: the checkpoint's config.json has no audio_config")
    cfg = AudioConfig.from_hf(checkpoint_config)
    check_audio_budgets(budgets, clips)
    expected = audio_param_shapes(cfg)
    check_shapes(tensor_shapes, expected, "checkpoint")
    names = tuple(sorted(expected))
    c, k = cfg.attention_chunk_size, cfg.conv_kernel_size
    context = c + cfg.max_past + cfg.attention_context_right
    inputs = (
        Tensor("frames", ("num_frames", MEL_BINS), "float32"),
        Tensor("first_taps", ("audio_rows", 3), "int32"),
        Tensor("second_taps", ("audio_size", 3), "int32"),
        Tensor("chunk_queries", ("audio_chunks", c), "int32"),
        Tensor("chunk_keys", ("audio_chunks", context), "int32"),
        Tensor("token_slots", ("audio_size",), "int32"),
        Tensor("causal_taps", ("audio_size", k), "int32"),
    )
    outputs = (Tensor("audio_embeds", ("audio_size", cfg.text_hidden_size), "float32"),)
    specs = tuple({"name": f"audio_{b}", "symbols": _symbols(cfg, b, clips)} for b in budgets)
    fn = _audio_forward(cfg, names, use_functions)
    plain = _audio_forward(cfg, names, False)

    return GraphSpec(
        name="audio",
        kind="audio",
        options={"budgets": list(budgets), "clips": clips},
        inputs=inputs,
        outputs=outputs,
        weights=names,
        fn=fn,
        reference=eager_reference(plain, inputs, outputs, names),
        sample=_audio_sample(cfg, clips),
        specializations=specs,
    )


def check_audio_budgets(budgets, clips):
    """Budgets: distinct ints in [1, 750] (soft tokens per call); clips: an int ≥ 1."""
    if isinstance(clips, bool) or not isinstance(clips, int) or clips < 1:
        raise GraphError(f"audio clips {clips!r}: expected an int >= 1")
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_SOFT_TOKENS:
            raise GraphError(f"audio budget {b!r}: expected an int in [1, {MAX_SOFT_TOKENS}]")
    if len(set(budgets)) != len(budgets):
        raise GraphError(f"audio budgets {list(budgets)} repeat a value")
