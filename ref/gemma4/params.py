"""The parameter shapes each Gemma 4 module expects, keyed by the checkpoint's own names.

Derived by an abstract `init` of the module (no array is allocated), so these facts cannot
drift from the modules; codegen checks a checkpoint against them and builds test checkpoints.
"""

from functools import lru_cache

import jax
import jax.numpy as jnp

from ref.attention import reference
from ref.gemma4 import text as T
from ref.gemma4 import vision as V
from ref.gemma4.attention_stack import AttentionLayer
from ref.gemma4.kv_cache import init_cache

TEXT = "model.language_model."
VISION = "model.vision_tower."
EMBED_VISION = "model.embed_vision.embedding_projection.weight"


def dotted(tree, prefix=""):
    """{dotted name: leaf} of a nested params dict, names sorted."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat[prefix + ".".join(str(k.key) for k in path)] = leaf
    return dict(sorted(flat.items()))


def nested(names, leaves, prefix=""):
    """Inverse of `dotted`: a nested params dict from dotted names (`prefix` stripped)."""
    tree = {}
    for name, leaf in zip(names, leaves, strict=True):
        *path, last = name[len(prefix) :].split(".")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def _shapes(module, *args, prefix=""):
    tree = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *args))["params"]
    return {n: tuple(s.shape) for n, s in dotted(tree, prefix).items()}


@lru_cache(maxsize=64)
def vision_param_shapes(cfg):
    """{dotted name: shape} of the packed tower's parameters (no prefix; one dict per config,
    not to be changed). cfg: VisionConfig."""
    k2 = cfg.pooling_kernel_size**2
    return _shapes(
        V.VisionModel(cfg),
        jnp.zeros((k2, cfg.patch_dim), jnp.float32),
        jnp.zeros((k2, 2), jnp.int32),
        jnp.zeros((k2,), jnp.int32),
        jnp.zeros((1, k2), jnp.int32),
    )


@lru_cache(maxsize=256)
def attention_param_shapes(cfg, i):
    """{checkpoint name: shape} of text layer i's attention parameters. cfg: TextConfig."""
    kv = jnp.zeros((1, cfg.kv_heads[i], 1, cfg.head_dims[i]), jnp.float32)
    pos = jnp.zeros((1, 1), jnp.int32)
    groups = (pos,) if cfg.bidirectional_vision else ()
    h = jnp.zeros((1, 1, cfg.hidden_size), jnp.float32)
    layer = AttentionLayer(cfg, i, None)
    return _shapes(layer, h, pos, kv, kv, *groups, prefix=f"{TEXT}layers.{i}.")


@lru_cache(maxsize=64)
def text_param_shapes(cfg):
    """{checkpoint name: shape} of the whole text decoder (`model.language_model.…`; one dict per
    config, not to be changed)."""
    ids = jnp.zeros((1, 1), jnp.int32)
    cache = init_cache(cfg, 1, 2, slots_only=True)
    return _shapes(T.TextModel(cfg), ids, ids, cache, None, None, reference, prefix=TEXT)
