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
from functools import lru_cache, partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax2onnx import onnx_function
from jax2onnx.plugins.plugin_system import PLUGIN_REGISTRY

from ref import attention, cache
from ref.blocking import BlockingConfig
from ref.cache import fold as fold_cache
from ref.cache import scatter_positions, unfold
from ref.gemma4 import text as T
from ref.gemma4 import vision as V
from ref.gemma4.config import VisionConfig
from ref.gemma4.packing import pack
from ref.gemma4.text_config import FULL, SLIDING, TextConfig
from ref.gemma4.tower import tower_apply

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

# The repeated layers being exported: {slot: (module, n_inputs, treedef)}, filled by the
# interceptor and read by the slot's layer function, which jax2onnx may trace again after the
# call returns; so it lives for the whole export (`layer_scope`). One slot per distinct layer
# (the vision layer; each text attention layer type), each its own ONNX function, because the
# retrace sees only the slot's last module. "inside" stops re-interception.
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


def _apply_layer(slot, x, *args):
    """The repeated layer on `x`, its other inputs, then its weights (module from `_LAYER`)."""
    module, n_inputs, treedef = _LAYER.get()[slot]
    params = jax.tree_util.tree_unflatten(treedef, args[n_inputs:])
    token = _INSIDE.set(True)
    try:
        return module.apply({"params": params}, x, *args[:n_inputs])
    finally:
        _INSIDE.reset(token)


def layer_function(x, *args):
    """One repeated layer as an ONNX function (module-level, flat array arguments: what
    jax2onnx's `@onnx_function` needs). Calls through this name are patched while tracing."""
    return _apply_layer("layer", x, *args)


def sliding_attention_function(x, *args):
    """A sliding-window text attention layer as an ONNX function returning a tuple (a
    jax2onnx function primitive is either single- or multiple-result)."""
    return tuple(_apply_layer(SLIDING, x, *args))


def full_attention_function(x, *args):
    """A full-attention text layer as an ONNX function returning a tuple."""
    return tuple(_apply_layer(FULL, x, *args))


onnx_function(layer_function, unique=True, name="Layer")
onnx_function(sliding_attention_function, unique=True, name="SlidingAttentionLayer")
onnx_function(full_attention_function, unique=True, name="FullAttentionLayer")
# As jax2onnx's own multi-output example does (plugins/examples/eqx/gpt_oss.py).
for _fn in (sliding_attention_function, full_attention_function):
    PLUGIN_REGISTRY[f"onnx_fn::{__name__}.{_fn.__name__}"].primitive.multiple_results = True
# By name: jax2onnx patches the module attribute while tracing, so the call must look it up.
_FUNCTIONS = {
    "layer": "layer_function",
    SLIDING: "sliding_attention_function",
    FULL: "full_attention_function",
}


def _layer_type(module):
    """The slot of a text attention layer: its layer type."""
    return module.config.layer_types[module.layer]


def _route_layers(layer_type, use_functions, slot=lambda module: "layer"):
    """An interceptor sending each `layer_type.__call__` through its slot's layer function
    (`slot(module)` names it: "layer", or a text layer type)."""

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
        key = slot(module)
        state[key] = (module.clone(parent=None, name=None), len(args) - 1, treedef)
        if use_functions:
            return globals()[_FUNCTIONS[key]](*args, *leaves)
        return _apply_layer(key, *args, *leaves)

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
        embed_params = None
        if embed:
            embed_params = _subtree(params, embed_vision_name(prefix).rsplit(".", 2)[0])
        with nn.intercept_methods(_route_layers(V.EncoderLayer, use_functions)):
            out = tower_apply(
                _subtree(params, prefix),
                embed_params,
                patches,
                positions,
                segment_ids,
                pool_index,
                config=cfg,
            )
        return (out["embeds"] if embed else out["pooled"],)

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


class AttentionLayer(nn.Module):
    """`layers.{i}`: Gemma 4's text attention over this layer's own KV cache, plus the residual.

    The attention is `ref.gemma4.text.Attention` itself (as `self_attn`: q/k/v projections,
    q/k/v norms, the layer type's RoPE, scale 1, attention_k_eq_v); this module only chooses
    its cache write (`ref.cache.update`, slot = position), its mask arguments
    (`ref.gemma4.text.layer_mask_args`) and its kernel (`ref.attention.blocked` in one mode,
    or the dense `reference` when `blocking` is None).
    """

    config: TextConfig
    layer: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, past_key, past_value, *group_ids):
        """h: [B, S, D]; position_ids: [B, S] (−1 = padding); past_*: [B, Hkv, T, hd] (or
        [1, B·Hkv, T, hd] with batch_fold); group_ids: ([B, S] vision-run ids, −1 = text) iff
        the config's vision runs are bidirectional → (h [B, S, D], key, value like past_*)."""
        c, b = self.config, h.shape[0]
        fold = self.blocking is not None and self.blocking.batch_fold
        if fold:
            past_key, past_value = unfold(past_key, b), unfold(past_value, b)
        kv_pos = cache.causal_positions(position_ids, past_key.shape[2])
        groups = group_ids[0] if group_ids else None
        # Only this call's run ids matter: every cached key of an earlier call sits at a
        # smaller position than all of this call's queries, so it is visible causally anyway.
        kv_group = None
        if groups is not None:
            kv_group = scatter_positions(jnp.full_like(kv_pos, -1), groups, position_ids)
        seen = {"kv_pos": kv_pos, "kv_group": kv_group}
        mask_args = T.layer_mask_args(c, position_ids, groups, seen, seen)
        kernel = attention.reference
        if self.blocking is not None:
            kernel = partial(attention.blocked, config=self.blocking)

        def write(kv, k, v):
            stored = cache.update(*kv, k, v, position_ids)
            return stored, tuple(fold_cache(x) for x in stored) if fold else stored

        out, (key, value), _ = T.Attention(c, self.layer, name="self_attn")(
            h,
            position_ids,
            (past_key, past_value),
            mask_args[c.layer_types[self.layer]],
            kernel,
            write,
        )
        if fold:
            key, value = fold_cache(key), fold_cache(value)
        return h + out, key, value


class AttentionLayers(nn.Module):
    """`model.language_model.layers`: the first n layers, each with its own retained KV cache."""

    config: TextConfig
    n: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, caches, group_ids):
        """caches: (key, value) per layer; group_ids: () or ([B, S],) → (h, new caches)."""
        new = []
        for i in range(self.n):
            layer = AttentionLayer(self.config, i, self.blocking, name=str(i))
            h, key, value = layer(h, position_ids, *caches[i], *group_ids)
            new.append((key, value))
        return h, tuple(new)


TEXT_LAYERS = "model.language_model.layers."


def text_config(checkpoint_config):
    """The `TextConfig` of a Gemma 4 checkpoint's text part, None without a text_config."""
    if not isinstance(checkpoint_config.get("text_config"), dict):
        return None
    try:
        return TextConfig.from_hf(checkpoint_config)
    except ValueError as e:
        raise GraphError(f"text_config: {e}") from e


def _cache_shape(cfg, i):
    return (cfg.kv_heads[i], cfg.head_dims[i])


@lru_cache(maxsize=256)
def attention_param_shapes(cfg, i):
    """{checkpoint name: shape} of text layer i's attention parameters."""
    kv = jnp.zeros((1, cfg.kv_heads[i], 1, cfg.head_dims[i]), jnp.float32)
    pos = jnp.zeros((1, 1), jnp.int32)
    groups = (pos,) if cfg.bidirectional_vision else ()
    h = jnp.zeros((1, 1, cfg.hidden_size), jnp.float32)
    layer = AttentionLayer(cfg, i, None)
    shapes = jax.eval_shape(lambda: layer.init(jax.random.PRNGKey(0), h, pos, kv, kv, *groups))
    return {n: tuple(s.shape) for n, s in flatten(shapes["params"], f"{TEXT_LAYERS}{i}.").items()}


def attention_layers_available(checkpoint_config, tensor_shapes):
    """How many leading text layers an attention graph can stack: layers that own their KV
    cache (KV-sharing consumers have none), whose tensors the checkpoint holds with the
    config's shapes, and whose head layout equals that of the first layer of their type
    (each layer type is one ONNX function, so its layers must share shapes)."""
    cfg = text_config(checkpoint_config)
    if cfg is None:
        return 0
    first_of_type = {}
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_types[i]
        first = first_of_type.setdefault(kind, i)
        if cfg.shares_kv(i) or _cache_shape(cfg, i) != _cache_shape(cfg, first):
            return i
        if any(
            tuple(tensor_shapes.get(n, ())) != s for n, s in attention_param_shapes(cfg, i).items()
        ):
            return i
    return cfg.num_hidden_layers


def _group_ids(positions, rng):
    """Random vision runs [B, S] int32: per row one run of valid tokens (id = its first
    position, as `ref.gemma4.text.vision_runs` numbers them) or none; −1 elsewhere."""
    b, s = positions.shape
    groups = np.full((b, s), -1, np.int32)
    for r in range(b):
        valid = int(np.sum(positions[r] >= 0))
        if valid and rng.random() < 0.8:
            lo = int(rng.integers(0, valid))
            hi = int(rng.integers(lo + 1, valid + 1))
            groups[r, lo:hi] = positions[r, lo]
    return groups


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
    """A stack of the first `layers` Gemma 4 text attention layers in one blocking mode, each
    layer's KV cache as retained state (its own shape: full layers may have wider heads).

    Static shapes (block boundaries are compile-time constants); the graph's I/O carry the
    symbols batch_size, seq_len, ctx_len, bound by its one specialization.
    """
    cfg = text_config(checkpoint_config)
    if cfg is None:
        raise GraphError("no text_config: a vision-only checkpoint has no attention graphs")
    available = attention_layers_available(checkpoint_config, tensor_shapes)
    if not 1 <= layers <= available:
        raise GraphError(
            f"attention layers {layers}: the checkpoint has 1..{available} stackable layers "
            "(leading layers owning their KV cache, one head layout per layer type)"
        )
    if seq_len > ctx_len:
        raise GraphError(f"seq_len {seq_len} must be <= ctx_len {ctx_len}")
    try:
        blocking = blocking_config(mode, options)
        if blocking is not None:
            for kv_heads in sorted({cfg.kv_heads[i] for i in range(layers)}):
                blocking.plan(batch_size, cfg.num_attention_heads, kv_heads, seq_len, ctx_len)
    except ValueError as e:
        raise GraphError(f"blocking {mode!r} {options}: {e}") from e
    expected = {n: s for i in range(layers) for n, s in attention_param_shapes(cfg, i).items()}
    _require(tensor_shapes, expected)
    names = tuple(sorted(expected))
    fold = blocking is not None and blocking.batch_fold
    symbols = {"batch_size": batch_size, "seq_len": seq_len, "ctx_len": ctx_len}

    def cache_shape(i):
        kv_heads, hd = _cache_shape(cfg, i)
        if not fold:
            return ("batch_size", kv_heads, "ctx_len", hd)
        rows = "batch_kv_heads" if kv_heads == cfg.kv_heads[0] else f"batch_kv_heads_{kv_heads}"
        symbols[rows] = batch_size * kv_heads
        return (1, rows, "ctx_len", hd)

    act = (
        Tensor("hidden_states", ("batch_size", "seq_len", cfg.hidden_size), "float32"),
        Tensor("position_ids", ("batch_size", "seq_len"), "int32"),
    )
    if cfg.bidirectional_vision:
        act += (Tensor("group_ids", ("batch_size", "seq_len"), "int32"),)
    cache_in = tuple(
        Tensor(f"past_{kind}.{i}", cache_shape(i), "float32")
        for i in range(layers)
        for kind in ("key", "value")
    )
    outputs = (Tensor("hidden_states_out", act[0].shape, "float32"),) + tuple(
        Tensor(t.name + "_RetainedState", t.shape, t.dtype) for t in cache_in
    )
    stack = AttentionLayers(cfg, layers, blocking)
    dense = AttentionLayers(cfg, layers, None)
    n_act = len(act)

    def forward(module, routed):
        def fn(*args):
            (hidden_states, position_ids, *groups), caches = args[:n_act], args[n_act:]
            params = nest(names, caches[2 * layers :], TEXT_LAYERS)
            caches = caches[: 2 * layers]
            pairs = tuple(zip(caches[0::2], caches[1::2], strict=True))
            with nn.intercept_methods(_route_layers(AttentionLayer, routed, slot=_layer_type)):
                h, new = module.apply(
                    {"params": params}, hidden_states, position_ids, pairs, tuple(groups)
                )
            return (h,) + tuple(x for pair in new for x in pair)

        return fn

    plain = forward(dense, False)

    def reference(feed, weights):
        args = [feed[t.name] for t in act + cache_in]
        if fold:
            args[n_act:] = [unfold(jnp.asarray(a), batch_size) for a in args[n_act:]]
        out = plain(*args, *(jnp.asarray(weights[n], jnp.float32) for n in names))
        out = [out[0]] + [fold_cache(x) if fold else x for x in out[1:]]
        return {t.name: np.asarray(x) for t, x in zip(outputs, out, strict=True)}

    def sample(sym, rng):
        """Contiguous positions from a random start (a prefix of the cache is history);
        a random tail of each row is padding (−1); a random vision run per row."""
        b, s, t = sym["batch_size"], sym["seq_len"], sym["ctx_len"]
        start = rng.integers(0, t - s + 1, (b, 1))
        pos = (start + np.arange(s)[None, :]).astype(np.int32)
        pad = rng.integers(0, s // 2 + 1, b)
        pos[np.arange(s)[None, :] >= (s - pad)[:, None]] = -1
        feed = {
            "hidden_states": rng.standard_normal((b, s, cfg.hidden_size), dtype=np.float32),
            "position_ids": pos,
        }
        if cfg.bidirectional_vision:
            feed["group_ids"] = _group_ids(pos, rng)
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
