"""Gemma 4 12B Unified's embedder graphs, in place of the towers (`ref.gemma4.unified`):

- `vision` (kind "embed_vision"): `vision_size` blocks of (p·k)²·3 pixels in [0, 1] and their
  (x, y) → `vision_embeds` [vision_size, text_hidden], one specialization per soft-token
  budget. Every step is per token, so the runner packs a row's images one after another and
  fills the rest with zero blocks at (0, 0), whose rows it drops.
- `audio` (kind "embed_audio"): `audio_size` frames of 640 samples → `audio_embeds`
  [audio_size, text_hidden], one specialization per budget (frames per call).

Weights under the checkpoint's names: `model.vision_embedder.*`, `model.embed_vision.*`,
`model.embed_audio.*`.
"""

import jax
import jax.numpy as jnp
import numpy as np

from codegen.graphs import GraphError, GraphSpec, Tensor, eager_reference
from ref.gemma4 import unified as E
from ref.gemma4 import unified_config as U
from ref.gemma4.images import BUDGETS
from ref.gemma4.params import dotted, nested
from weights import check_shapes

MODEL_TYPE = U.MODEL_TYPE


def is_unified(checkpoint_config):
    """Whether config.json is a gemma4_unified one."""
    return isinstance(checkpoint_config, dict) and checkpoint_config.get("model_type") == MODEL_TYPE


def _shapes(module, *args):
    tree = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args))["params"]
    return {n: tuple(s.shape) for n, s in dotted(tree, "model.").items()}


def vision_param_shapes(cfg):
    """{checkpoint name: shape} of the vision embedder (no bytes read)."""
    patches = jnp.zeros((1, cfg.patch_dim), jnp.float32)
    return _shapes(E.VisionEmbedder(cfg), patches, jnp.zeros((1, 2), jnp.int32))


def audio_param_shapes(cfg):
    """{checkpoint name: shape} of embed_audio."""
    return {"model.embed_audio.embedding_projection.weight": (cfg.text_hidden_size,
                                                              cfg.audio_embed_dim)}  # fmt: skip


def _checked(tensor_shapes, expected):
    check_shapes(tensor_shapes, expected, "checkpoint")
    return tuple(sorted(expected))


def _spec(kind, name, options, inputs, outputs, names, fn, sample, specs):
    return GraphSpec(
        name=name, kind=kind, options=options, inputs=inputs, outputs=outputs, weights=names,
        fn=fn, reference=eager_reference(fn, inputs, outputs, names), sample=sample,
        specializations=specs,
    )  # fmt: skip


def embed_vision_graph(checkpoint_config, tensor_shapes, budgets, *, use_functions=True):
    """The vision embedder over `vision_size` blocks, one specialization per budget."""
    cfg = U.vision_config(checkpoint_config)
    if cfg is None:
        raise GraphError("no vision embedder: the gemma4_unified config has no vision_config")
    for b in budgets:
        if b not in BUDGETS:
            raise GraphError(f"budget {b}: expected one of {BUDGETS}")
    names = _checked(tensor_shapes, vision_param_shapes(cfg))

    def fn(pixel_patches, positions, *weights):
        params = nested(names, weights, "model.")
        return (E.VisionEmbedder(cfg).apply({"params": params}, pixel_patches, positions),)

    def sample(symbols, rng):
        n = symbols["vision_size"]
        side = min(cfg.mm_posemb_size, 40)
        return {
            "pixel_patches": rng.random((n, cfg.patch_dim), dtype=np.float32),
            "positions": rng.integers(0, side, (n, 2)).astype(np.int32),
        }

    inputs = (
        Tensor("pixel_patches", ("vision_size", cfg.patch_dim), "float32"),
        Tensor("positions", ("vision_size", 2), "int32"),
    )
    outputs = (Tensor("vision_embeds", ("vision_size", cfg.text_hidden_size), "float32"),)
    specs = tuple({"name": f"vision_{b}", "symbols": {"vision_size": b}} for b in budgets)
    options = {"budgets": list(budgets)}
    return _spec("embed_vision", "vision", options, inputs, outputs, names, fn, sample, specs)


def embed_audio_graph(checkpoint_config, tensor_shapes, budgets, *, use_functions=True):
    """embed_audio over `audio_size` frames, one specialization per budget (frames a call)."""
    cfg = U.audio_config(checkpoint_config)
    if cfg is None:
        raise GraphError("no audio embedder: the gemma4_unified config has no audio_config")
    for b in budgets:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise GraphError(f"audio budget {b!r}: expected an int >= 1 (frames of 640 samples)")
    if len(set(budgets)) != len(budgets):
        raise GraphError(f"audio budgets {list(budgets)} repeat a value")
    names = _checked(tensor_shapes, audio_param_shapes(cfg))
    projection = E.Projection(cfg.text_hidden_size, cfg.rms_norm_eps)

    def fn(frames, *weights):
        params = nested(names, weights, "model.embed_audio.")
        return (projection.apply({"params": params}, frames),)

    def sample(symbols, rng):
        shape = (symbols["audio_size"], cfg.audio_embed_dim)
        return {"frames": (0.3 * rng.standard_normal(shape)).astype(np.float32)}

    inputs = (Tensor("frames", ("audio_size", cfg.audio_embed_dim), "float32"),)
    outputs = (Tensor("audio_embeds", ("audio_size", cfg.text_hidden_size), "float32"),)
    specs = tuple({"name": f"audio_{b}", "symbols": {"audio_size": b}} for b in budgets)
    options = {"budgets": list(budgets)}
    return _spec("embed_audio", "audio", options, inputs, outputs, names, fn, sample, specs)
