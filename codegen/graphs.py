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

from ref.blocking import BlockingConfig
from ref.cache import fold as fold_cache
from ref.cache import unfold
from ref.gemma4 import vision as V
from ref.gemma4.attention_stack import AttentionLayer, AttentionLayers
from ref.gemma4.config import VisionConfig
from ref.gemma4.packing import pack
from ref.gemma4.params import (
    TEXT,
    attention_param_shapes,
    nested,
    vision_param_shapes,
)
from ref.gemma4.text_config import SLIDING, TextConfig
from ref.gemma4.tower import tower_apply
from weights import check_shapes

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

# The repeated layers being exported: {function name: _Slot}, filled by the interceptor and read
# by the slot's layer function, which jax2onnx traces again after the call returns; so it
# lives for the whole export (`layer_scope`). One slot per distinct layer kind (the vision
# layer; each kind of text layer), each its own ONNX function, because the retrace sees only
# the slot's last module. "inside" stops re-interception.
_LAYER = contextvars.ContextVar("codegen_layer", default=None)
_INSIDE = contextvars.ContextVar("codegen_inside_layer", default=False)


@contextlib.contextmanager
def layer_scope():
    """Hold the repeated layers' static descriptions while a graph is traced and lowered."""
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
    sample(symbols, rng) → dict of random inputs for one specialization. static: the symbols
    bound at trace time to the first specialization's values (block bounds are compile-time),
    the graph's I/O then labelled with them; the other symbols stay symbolic in the trace.
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
    static: tuple = ()


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One routed layer call: the module, where its array arguments go among the static ones,
    its parameters' tree, and (once known) its outputs: their tree and, per output leaf,
    ("in", j) for a passthrough of array input j or ("out", k) for the function's k-th
    distinct result (an ONNX function output must be a distinct value made inside it)."""

    module: nn.Module
    args_tree: object
    static: tuple  # per argument leaf: None for an array (a function input), else the value
    params_tree: object
    out_tree: object = None
    out_map: tuple = ()

    def apply(self, arrays):
        """The module on its array arguments, then its parameters' leaves."""
        it = iter(arrays)
        leaves = [next(it) if s is None else s for s in self.static]
        args, kwargs = jax.tree_util.tree_unflatten(self.args_tree, leaves)
        params = jax.tree_util.tree_unflatten(self.params_tree, list(it))
        token = _INSIDE.set(True)
        try:
            return self.module.apply({"params": params}, *args, **kwargs)
        finally:
            _INSIDE.reset(token)

    def results(self, arrays):
        """(the distinct results made inside the layer, their out_map, the outputs' tree)."""
        out = self.apply(arrays)
        leaves, tree = jax.tree_util.tree_flatten(out)
        inputs = {id(a): j for j, a in enumerate(arrays)}
        made, out_map = {}, []
        for leaf in leaves:
            if id(leaf) in inputs:
                out_map.append(("in", inputs[id(leaf)]))
            else:
                out_map.append(("out", made.setdefault(id(leaf), len(made))))
        distinct = list({id(x): x for x in leaves if id(x) not in inputs}.values())
        return tuple(distinct), tuple(out_map), tree


def _layer_body(name, *arrays):
    """A routed layer's distinct results (module from the slot `name` of `_LAYER`)."""
    return _LAYER.get()[name].results(arrays)[0]


def layer_function(name):
    """The module-level ONNX function (jax2onnx `@onnx_function`: flat array arguments and
    results) for layer kind `name`, registered on first use; look it up again by
    `globals()[...]` at call time, since jax2onnx patches the module attribute while tracing."""
    attr = f"layer_fn_{name}"
    if attr not in globals():

        def fn(*arrays):
            return _layer_body(name, *arrays)

        fn.__name__ = fn.__qualname__ = attr
        fn.__module__ = __name__
        globals()[attr] = fn
        onnx_function(fn, unique=True, name=name)
        # As jax2onnx's own multi-output example does (plugins/examples/eqx/gpt_oss.py).
        PLUGIN_REGISTRY[f"onnx_fn::{__name__}.{attr}"].primitive.multiple_results = True
    return attr


def _is_array(leaf):
    return isinstance(leaf, (jax.Array, np.ndarray))


def route_layers(layer_type, use_functions, kind):
    """An interceptor sending each `layer_type.__call__` through the ONNX function of its kind
    (`kind(module)` names it; `layer_function(name)` must have registered it before tracing),
    or, without functions, applying it as the function would. Array arguments become function
    inputs; every other argument (ints, kernels, write policies) is static to the kind."""

    def interceptor(next_fun, args, kwargs, context):
        mine = isinstance(context.module, layer_type) and context.method_name == "__call__"
        if not mine or _INSIDE.get():
            return next_fun(*args, **kwargs)
        state = _LAYER.get()
        if state is None:
            raise GraphError("layers are routed only inside codegen.graphs.layer_scope()")
        module, name = context.module, kind(context.module)
        leaves, args_tree = jax.tree_util.tree_flatten((args, kwargs))
        static = tuple(None if _is_array(x) else x for x in leaves)
        arrays = [x for x in leaves if _is_array(x)]
        p_leaves, p_tree = jax.tree_util.tree_flatten(module.variables["params"])
        slot = _Slot(module.clone(parent=None, name=None), args_tree, static, p_tree)
        old = state.get(name)
        if old is not None:
            if (old.args_tree, old.static, old.params_tree) != (args_tree, static, p_tree):
                raise GraphError(f"layers of kind {name!r} differ in structure or static inputs")
            slot = dataclasses.replace(slot, out_tree=old.out_tree, out_map=old.out_map)
        state[name] = slot
        inputs = [*arrays, *p_leaves]
        if not use_functions:
            return slot.apply(inputs)
        if slot.out_tree is None:
            found = {}

            def probe(*a):
                distinct, found["map"], found["tree"] = slot.results(a)
                return distinct

            jax.eval_shape(probe, *inputs)
            slot = dataclasses.replace(slot, out_tree=found["tree"], out_map=found["map"])
            state[name] = slot
        made = globals()[layer_function(name)](*inputs)
        leaves = [inputs[k] if src == "in" else made[k] for src, k in slot.out_map]
        return jax.tree_util.tree_unflatten(slot.out_tree, leaves)

    return interceptor


# ---------------------------------------------------------------------------- vision tower


def vision_prefix(tensor_names):
    """Where the tower's names start: "model.vision_tower." in a full Gemma 4 checkpoint
    ("vision_tower." in some saves), "" in a saved vision model; None without a tower."""
    for prefix in ("model.vision_tower.", "vision_tower.", ""):
        if prefix + "patch_embedder.input_proj.weight" in tensor_names:
            return prefix
    return None


def embed_vision_name(prefix):
    """The embed_vision projection's name beside a tower under `prefix`."""
    return prefix.replace("vision_tower.", "embed_vision.") + "embedding_projection.weight"


def _subtree(params, prefix):
    for key in prefix.rstrip(".").split(".") if prefix else ():
        params = params[key]
    return params


def _VISION_LAYER(module):
    return "Layer"


def _vision_forward(cfg, prefix, names, use_functions, embed):
    """fn(patches, positions, segment_ids, pool_index, *weights) → (embeddings,)."""

    def fn(patches, positions, segment_ids, pool_index, *weights):
        params = nested(names, weights)
        embed_params = None
        if embed:
            embed_params = _subtree(params, embed_vision_name(prefix).rsplit(".", 2)[0])
        with nn.intercept_methods(route_layers(V.EncoderLayer, use_functions, _VISION_LAYER)):
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
    check_shapes(tensor_shapes, expected, "checkpoint")
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


TEXT_LAYERS = TEXT + "layers."


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


def _attention_kind(module):
    """The ONNX function of a text attention layer: one per layer type."""
    kind = module.config.layer_types[module.layer]
    return "SlidingAttentionLayer" if kind == SLIDING else "FullAttentionLayer"


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
    check_shapes(tensor_shapes, expected, "checkpoint")
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
    if use_functions:
        for kind in {_attention_kind(AttentionLayer(cfg, i, None)) for i in range(layers)}:
            layer_function(kind)
    stack = AttentionLayers(cfg, layers, blocking)
    dense = AttentionLayers(cfg, layers, None)
    n_act = len(act)

    def forward(module, routed):
        def fn(*args):
            (hidden_states, position_ids, *groups), caches = args[:n_act], args[n_act:]
            params = nested(names, caches[2 * layers :], TEXT_LAYERS)
            caches = caches[: 2 * layers]
            pairs = tuple(zip(caches[0::2], caches[1::2], strict=True))
            with nn.intercept_methods(route_layers(AttentionLayer, routed, _attention_kind)):
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
        static=tuple(symbols),
    )
