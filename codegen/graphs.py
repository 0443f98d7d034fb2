"""What gets exported: each graph as a traceable function over flat arrays plus its contract.

A `GraphSpec` says the graph's inputs (with specialization symbols in their shapes), its
outputs, the checkpoint tensors it takes as weights (in call order), its specializations,
its retained-state pairs, how to draw random inputs for a specialization, and the `ref`
answer to compare with. Builders here compose `ref` only; nothing reads weight bytes.

Repeated layers become ONNX functions through `nn.intercept_methods`: the interceptor routes
each layer's `__call__` through a module-level function with flat array arguments (what
jax2onnx's `@onnx_function` needs); the static config rides in a context variable because
an ONNX function's arguments must all be arrays.
"""

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax2onnx import onnx_function
from jax2onnx.plugins.plugin_system import PLUGIN_REGISTRY

from ref import attention, cache
from ref.blocking import BlockingConfig
from ref.cache import fold as fold_cache
from ref.cache import unfold
from ref.gemma4 import vision as V
from ref.gemma4.config import VisionConfig
from ref.gemma4.packing import pack
from ref.layers import linear

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

# The repeated layer being exported: {"layer": (module, n_inputs, treedef)}, filled by the
# interceptor and read by `layer_function`, which jax2onnx may trace again after the call
# returns; so it lives for the whole export (`layer_scope`). "inside" stops re-interception.
_LAYER = contextvars.ContextVar("codegen_layer", default=None)
_INSIDE = contextvars.ContextVar("codegen_inside_layer", default=False)


@contextlib.contextmanager
def layer_scope():
    """Hold the repeated layer's static description while a graph is traced and lowered."""
    token = _LAYER.set({})
    try:
        yield
    finally:
        _LAYER.reset(token)


class GraphError(ValueError):
    """A graph cannot be built from this checkpoint with these options."""


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A graph input or output: shape entries are ints or specialization symbols."""

    name: str
    shape: tuple
    dtype: str

    def concrete(self, symbols):
        """The shape with every symbol replaced by its value in `symbols`."""
        return tuple(symbols[d] if isinstance(d, str) else d for d in self.shape)


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """One exported graph.

    fn(*inputs, *weights) → tuple of outputs (traced by jax2onnx with abstract weights);
    reference(inputs, weights) → dict of outputs (dicts keyed by name, numpy arrays);
    sample(symbols, rng) → dict of random inputs for one specialization. static: traced at
    its one specialization's sizes, its I/O then labelled with the symbols.
    """

    name: str
    kind: str
    options: dict
    inputs: tuple
    outputs: tuple
    weights: tuple
    fn: Callable
    reference: Callable
    sample: Callable
    specializations: tuple
    retained: tuple = ()
    static: bool = False


def nest(names, leaves, prefix=""):
    """Nested params dict from dotted checkpoint names (`prefix` stripped)."""
    tree = {}
    for name, leaf in zip(names, leaves, strict=True):
        *path, last = name[len(prefix) :].split(".")
        node = tree
        for key in path:
            node = node.setdefault(key, {})
        node[last] = leaf
    return tree


def flatten(tree, prefix=""):
    """Inverse of `nest`: {dotted name: leaf}, names sorted."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat[prefix + ".".join(str(k.key) for k in path)] = leaf
    return dict(sorted(flat.items()))


def _apply_layer(x, *args):
    """The repeated layer on `x`, its other inputs, then its weights (module from `_LAYER`)."""
    module, n_inputs, treedef = _LAYER.get()["layer"]
    params = jax.tree_util.tree_unflatten(treedef, args[n_inputs:])
    token = _INSIDE.set(True)
    try:
        return module.apply({"params": params}, x, *args[:n_inputs])
    finally:
        _INSIDE.reset(token)


def layer_function(x, *args):
    """One repeated layer as an ONNX function (module-level, flat array arguments: what
    jax2onnx's `@onnx_function` needs). Calls through this name are patched while tracing."""
    return _apply_layer(x, *args)


def layer_function_multi(x, *args):
    """`layer_function` for a layer that returns a tuple (a separate ONNX function because a
    jax2onnx function primitive is either single- or multiple-result)."""
    return tuple(_apply_layer(x, *args))


onnx_function(layer_function, unique=True, name="Layer")
onnx_function(layer_function_multi, unique=True, name="LayerN")
# As jax2onnx's own multi-output example does (plugins/examples/eqx/gpt_oss.py).
PLUGIN_REGISTRY[f"onnx_fn::{__name__}.layer_function_multi"].primitive.multiple_results = True


def _route_layers(layer_type, use_functions, multi=False):
    """An interceptor sending each `layer_type.__call__` through `layer_function` (or
    `layer_function_multi` for a layer returning a tuple)."""

    def interceptor(next_fun, args, kwargs, context):
        mine = isinstance(context.module, layer_type) and context.method_name == "__call__"
        if not mine or _INSIDE.get():
            return next_fun(*args, **kwargs)
        if kwargs:
            raise GraphError(f"{layer_type.__name__} called with keywords {sorted(kwargs)}")
        module = context.module
        leaves, treedef = jax.tree_util.tree_flatten(module.variables["params"])
        state = _LAYER.get()
        if state is None:
            raise GraphError("layers are routed only inside codegen.graphs.layer_scope()")
        state["layer"] = (module.clone(parent=None, name=None), len(args) - 1, treedef)
        if use_functions:
            call = layer_function_multi if multi else layer_function
            return call(*args, *leaves)
        return _apply_layer(*args, *leaves)

    return interceptor


# ---------------------------------------------------------------------------- vision tower


def vision_prefix(tensor_names):
    """Where the tower's names start: "model.vision_tower." in a full Gemma 4 checkpoint
    ("vision_tower." in some saves), "" in a saved vision model; None without a tower."""
    for prefix in ("model.vision_tower.", "vision_tower.", ""):
        if prefix + "patch_embedder.input_proj.weight" in tensor_names:
            return prefix
    return None


def vision_param_shapes(cfg):
    """{dotted name: shape} of the packed tower's parameters (no prefix)."""
    k2 = cfg.pooling_kernel_size**2
    args = (
        jnp.zeros((k2, cfg.patch_dim), jnp.float32),
        jnp.zeros((k2, 2), jnp.int32),
        jnp.zeros((k2,), jnp.int32),
        jnp.zeros((1, k2), jnp.int32),
    )
    shapes = jax.eval_shape(lambda: V.VisionModel(cfg).init(jax.random.PRNGKey(0), *args))
    return {n: tuple(s.shape) for n, s in flatten(shapes["params"]).items()}


EMBED_VISION = "model.embed_vision.embedding_projection.weight"


def embed_vision_name(prefix):
    """The embed_vision projection's name beside a tower under `prefix`."""
    return prefix.replace("vision_tower.", "embed_vision.") + "embedding_projection.weight"


def _subtree(params, prefix):
    for key in prefix.rstrip(".").split(".") if prefix else ():
        params = params[key]
    return params


def _vision_forward(cfg, prefix, names, use_functions, embed):
    """fn(patches, positions, segment_ids, pool_index, *weights) → (embeddings,)."""

    def fn(patches, positions, segment_ids, pool_index, *weights):
        params = nest(names, weights)
        with nn.intercept_methods(_route_layers(V.EncoderLayer, use_functions)):
            out = V.VisionModel(cfg).apply(
                {"params": _subtree(params, prefix)}, patches, positions, segment_ids, pool_index
            )
        pooled = out["pooled"]
        if embed:
            w = _subtree(params, embed_vision_name(prefix).rsplit(".", 2)[0])
            pooled = V.EmbedVision(cfg).apply({"params": w}, pooled)
        return (pooled,)

    return fn


def _vision_sample(cfg):
    def sample(symbols, rng):
        """Random images packed into exactly `vision_size` soft tokens (filler included)."""
        k = cfg.pooling_kernel_size
        budget = symbols["vision_size"]
        grids, used = [], 0
        side_max = max(1, min(cfg.position_embedding_size, 12 * k) // k)
        while used < budget and len(grids) < 4:
            th, tw = (int(t) for t in rng.integers(1, side_max + 1, 2))
            if used + th * tw > budget:
                break
            grids.append((th * k, tw * k))
            used += th * tw
        if not grids:
            grids = [(k, k)]
        packing = pack(
            grids,
            pooling_kernel_size=k,
            position_embedding_size=cfg.position_embedding_size,
            budget=budget,
        )
        n = packing.positions.shape[0]
        return {
            "pixel_patches": rng.random((n, cfg.patch_dim), dtype=np.float32),
            "positions": packing.positions,
            "segment_ids": packing.segment_ids,
            "pool_index": packing.pool_index,
        }

    return sample


def vision_graph(checkpoint_config, tensor_shapes, budgets, *, use_functions=True):
    """The packed vision tower over `num_patches` patches pooled to `vision_size` tokens.

    tensor_shapes: {checkpoint name: shape}. One specialization per soft-token budget.
    """
    cfg = VisionConfig.from_hf(checkpoint_config)
    prefix = vision_prefix(tensor_shapes)
    if prefix is None:
        raise GraphError("no vision tower: missing tensor 'patch_embedder.input_proj.weight'")
    expected = {prefix + n: s for n, s in vision_param_shapes(cfg).items()}
    embed = prefix != "" and cfg.text_hidden_size is not None
    if embed:
        expected[embed_vision_name(prefix)] = (cfg.text_hidden_size, cfg.hidden_size)
    _require(tensor_shapes, expected)
    names = tuple(sorted(expected))
    k2 = cfg.pooling_kernel_size**2
    width = cfg.text_hidden_size if embed else cfg.hidden_size
    inputs = (
        Tensor("pixel_patches", ("num_patches", cfg.patch_dim), "float32"),
        Tensor("positions", ("num_patches", 2), "int32"),
        Tensor("segment_ids", ("num_patches",), "int32"),
        Tensor("pool_index", ("vision_size", k2), "int32"),
    )
    outputs = (Tensor("vision_embeds" if embed else "pooled", ("vision_size", width), "float32"),)
    specs = tuple(
        {"name": f"vision_{b}", "symbols": {"num_patches": b * k2, "vision_size": b}}
        for b in budgets
    )
    fn = _vision_forward(cfg, prefix, names, use_functions, embed)
    plain = _vision_forward(cfg, prefix, names, False, embed)

    def reference(feed, weights):
        args = [feed[t.name] for t in inputs]
        out = plain(*args, *(jnp.asarray(weights[n], jnp.float32) for n in names))
        return {outputs[0].name: np.asarray(out[0])}

    return GraphSpec(
        name="vision",
        kind="vision",
        options={"budgets": list(budgets)},
        inputs=inputs,
        outputs=outputs,
        weights=names,
        fn=fn,
        reference=reference,
        sample=_vision_sample(cfg),
        specializations=specs,
    )


def _require(tensor_shapes, expected):
    for name, shape in sorted(expected.items()):
        found = tensor_shapes.get(name)
        if found is None:
            raise GraphError(f"checkpoint lacks tensor {name!r} (expected shape {tuple(shape)})")
        if tuple(found) != tuple(shape):
            raise GraphError(f"tensor {name!r} has shape {tuple(found)}, expected {tuple(shape)}")


def check_budgets(budgets, ctx_len):
    """Soft-token budgets must be known sizes and fit the text context (vision_size < ctx_len)."""
    for b in budgets:
        if b not in SOFT_TOKEN_BUDGETS:
            raise GraphError(f"budget {b}: expected one of {SOFT_TOKEN_BUDGETS}")
        if ctx_len is not None and not b < ctx_len:
            raise GraphError(f"vision_size {b} must be < ctx_len {ctx_len}")
    if len(set(budgets)) != len(budgets):
        raise GraphError(f"budgets {list(budgets)} repeat a value")


# ------------------------------------------------------------------- attention layer stack

# Block options each mode gets when `--blocking all` (or a bare mode name) asks for defaults:
# two blocks along every cut axis, so each mode really splits the work.
DEFAULT_BLOCKING = {
    "kv": {"num_kv_blocks": 2},
    "q": {"num_q_blocks": 2},
    "h": {"head_block_size": 1},
    "qkv": {"num_q_blocks": 2, "num_kv_blocks": 2},
    "hq": {"head_block_size": 1, "num_q_blocks": 2},
    "hkv": {"head_block_size": 1, "num_kv_blocks": 2},
    "hqkv": {"head_block_size": 1, "num_q_blocks": 2, "num_kv_blocks": 2},
    "bhqkv": {"num_batch_blocks": 1, "head_block_size": 1, "num_q_blocks": 2, "num_kv_blocks": 2},
    "kv_headpar": {"num_kv_blocks": 2, "headpar_split": 2},
    "kv_batch_fold": {"num_kv_blocks": 2, "batch_fold": True},
    "prefill_q": {"prefill_block_chunks": 2},
    "prefill_kv": {"num_kv_blocks": 2},
    "prefill_qkv": {"prefill_block_chunks": 2, "num_kv_blocks": 2},
    "prefill_online": {"prefill_block_chunks": 2, "num_kv_blocks": 2},
}


def blocking_config(mode, options):
    """A `BlockingConfig` from a mode name (or a DEFAULT_BLOCKING alias) and its options."""
    if mode == "none":
        return None
    base = {"kv_headpar": "kv", "kv_batch_fold": "kv"}.get(mode, mode)
    return BlockingConfig(mode=base, **options)


class SelfAttention(nn.Module):
    """Projections, cache write at the token positions, (blocked) attention, output projection.

    Not Gemma 4's text attention (no norms, no RoPE: that graph comes with the text model);
    this is the cache + blocking path QAIC runs, with the checkpoint's projection weights.
    """

    heads: int
    kv_heads: int
    head_dim: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, past_key, past_value):
        """h: [B, S, D]; position_ids: [B, S] (−1 = padding); past_*: [B, Hkv, T, hd] (or
        [1, B·Hkv, T, hd] with batch_fold) → (h [B, S, D], key, value like past_*)."""
        b, s, d = h.shape
        hd = self.head_dim

        def project(name, heads):
            y = linear(h, V.Weight((heads * hd, d), name=name)())
            return jnp.swapaxes(y.reshape(b, s, heads, hd), 1, 2)

        q = project("q_proj", self.heads)
        k, v = project("k_proj", self.kv_heads), project("v_proj", self.kv_heads)
        fold = self.blocking is not None and self.blocking.batch_fold
        if fold:
            past_key, past_value = unfold(past_key, b), unfold(past_value, b)
        key, value = cache.update(past_key, past_value, k, v, position_ids)
        kv_pos = cache.causal_positions(position_ids, key.shape[2])
        scale = hd**-0.5
        if self.blocking is None:
            out = attention.reference(q, key, value, position_ids, kv_pos, scale=scale)
        else:
            if fold:
                key, value = fold_cache(key), fold_cache(value)
            out = attention.blocked(
                q, key, value, position_ids, kv_pos, config=self.blocking, scale=scale
            )
        out = jnp.swapaxes(out, 1, 2).reshape(b, s, self.heads * hd)
        return h + linear(out, V.Weight((d, self.heads * hd), name="o_proj")()), key, value


class AttentionLayer(nn.Module):
    """`layers.{i}`: holds `self_attn` (the checkpoint's naming)."""

    heads: int
    kv_heads: int
    head_dim: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, past_key, past_value):
        attn = SelfAttention(
            self.heads, self.kv_heads, self.head_dim, self.blocking, name="self_attn"
        )
        return attn(h, position_ids, past_key, past_value)


class AttentionLayers(nn.Module):
    """`model.language_model.layers`: n layers, each with its own retained KV cache."""

    n: int
    heads: int
    kv_heads: int
    head_dim: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, caches):
        """caches: (key, value) per layer → (h, new caches in the same order)."""
        new = []
        for i in range(self.n):
            dims = (self.heads, self.kv_heads, self.head_dim, self.blocking)
            h, key, value = AttentionLayer(*dims, name=str(i))(h, position_ids, *caches[i])
            new.append((key, value))
        return h, tuple(new)


TEXT_LAYER = "model.language_model.layers.{i}.self_attn.{proj}.weight"


def text_dims(checkpoint_config):
    """(hidden, heads, kv_heads, head_dim, layers) of the text part of a Gemma 4 config."""
    text = checkpoint_config.get("text_config")
    if not isinstance(text, dict):
        return None
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    missing = [k for k in keys if k not in text]
    if missing:
        raise GraphError(f"text_config lacks {missing}")
    return tuple(int(text[k]) for k in keys) + (int(text.get("num_hidden_layers", 0)),)


def _projection_shapes(d, heads, kv_heads, hd):
    return {
        "q_proj": (heads * hd, d),
        "k_proj": (kv_heads * hd, d),
        "v_proj": (kv_heads * hd, d),
        "o_proj": (d, heads * hd),
    }


def uniform_attention_layers(checkpoint_config, tensor_shapes):
    """How many leading text layers have q/k/v/o projections of the config's head layout
    (Gemma 4's full-attention layers may use other head sizes or share k and v)."""
    dims = text_dims(checkpoint_config)
    if dims is None:
        return 0
    want = _projection_shapes(*dims[:4])
    n = 0
    while all(
        tuple(tensor_shapes.get(TEXT_LAYER.format(i=n, proj=p), ())) == s for p, s in want.items()
    ):
        n += 1
    return n


def attention_graph(
    checkpoint_config,
    tensor_shapes,
    *,
    name,
    mode,
    options,
    layers,
    batch_size,
    seq_len,
    ctx_len,
    use_functions=True,
):
    """A stack of `layers` attention layers in one blocking mode, KV cache as retained state.

    Static shapes (block boundaries are compile-time constants); the graph's I/O carry the
    symbols batch_size, seq_len, ctx_len, bound by its one specialization.
    """
    dims = text_dims(checkpoint_config)
    if dims is None:
        raise GraphError("no text_config: a vision-only checkpoint has no attention graphs")
    d, heads, kv_heads, hd, available = dims
    if not 1 <= layers <= available:
        raise GraphError(f"attention layers {layers}: the checkpoint has 1..{available}")
    if seq_len > ctx_len:
        raise GraphError(f"seq_len {seq_len} must be <= ctx_len {ctx_len}")
    try:
        blocking = blocking_config(mode, options)
        if blocking is not None:
            blocking.plan(batch_size, heads, kv_heads, seq_len, ctx_len)
    except ValueError as e:
        raise GraphError(f"blocking {mode!r} {options}: {e}") from e
    expected = {
        TEXT_LAYER.format(i=i, proj=p): s
        for i in range(layers)
        for p, s in _projection_shapes(d, heads, kv_heads, hd).items()
    }
    _require(tensor_shapes, expected)
    names = tuple(sorted(expected))
    fold = blocking is not None and blocking.batch_fold
    cache_shape = (
        (1, "batch_kv_heads", "ctx_len", hd) if fold else ("batch_size", kv_heads, "ctx_len", hd)
    )
    symbols = {"batch_size": batch_size, "seq_len": seq_len, "ctx_len": ctx_len}
    if fold:
        symbols["batch_kv_heads"] = batch_size * kv_heads
    act = (
        Tensor("hidden_states", ("batch_size", "seq_len", d), "float32"),
        Tensor("position_ids", ("batch_size", "seq_len"), "int32"),
    )
    cache_in = tuple(
        Tensor(f"past_{kind}.{i}", cache_shape, "float32")
        for i in range(layers)
        for kind in ("key", "value")
    )
    outputs = (Tensor("hidden_states_out", act[0].shape, "float32"),) + tuple(
        Tensor(t.name + "_RetainedState", t.shape, t.dtype) for t in cache_in
    )
    stack = AttentionLayers(layers, heads, kv_heads, hd, blocking)
    dense = AttentionLayers(layers, heads, kv_heads, hd, None)

    def forward(module, routed):
        def fn(hidden_states, position_ids, *rest):
            caches = rest[: 2 * layers]
            params = nest(names, rest[2 * layers :])["model"]["language_model"]["layers"]
            pairs = tuple(zip(caches[0::2], caches[1::2], strict=True))
            with nn.intercept_methods(_route_layers(AttentionLayer, routed, multi=True)):
                h, new = module.apply({"params": params}, hidden_states, position_ids, pairs)
            return (h,) + tuple(x for pair in new for x in pair)

        return fn

    plain = forward(dense, False)

    def reference(feed, weights):
        args = [feed[t.name] for t in act + cache_in]
        if fold:
            args[2:] = [unfold(jnp.asarray(a), batch_size) for a in args[2:]]
        out = plain(*args, *(jnp.asarray(weights[n], jnp.float32) for n in names))
        out = [out[0]] + [fold_cache(x) if fold else x for x in out[1:]]
        return {t.name: np.asarray(x) for t, x in zip(outputs, out, strict=True)}

    def sample(sym, rng):
        """Contiguous positions from a random start (a prefix of the cache is history);
        a random tail of each row is padding (−1)."""
        b, s, t = sym["batch_size"], sym["seq_len"], sym["ctx_len"]
        start = rng.integers(0, t - s + 1, (b, 1))
        pos = (start + np.arange(s)[None, :]).astype(np.int32)
        pad = rng.integers(0, s // 2 + 1, b)
        pos[np.arange(s)[None, :] >= (s - pad)[:, None]] = -1
        feed = {
            "hidden_states": rng.standard_normal((b, s, d), dtype=np.float32),
            "position_ids": pos,
        }
        for tensor in cache_in:
            feed[tensor.name] = rng.standard_normal(tensor.concrete(sym), dtype=np.float32)
        return feed

    return GraphSpec(
        name=name,
        kind="attention",
        options={
            "mode": mode,
            "blocking": dict(options),
            "layers": layers,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "ctx_len": ctx_len,
        },
        inputs=act + cache_in,
        outputs=outputs,
        weights=names,
        fn=forward(stack, use_functions),
        reference=reference,
        sample=sample,
        specializations=({"name": "Prefill" if seq_len > 1 else "Decode", "symbols": symbols},),
        retained=tuple((t.name, t.name + "_RetainedState") for t in cache_in),
        static=True,
    )
