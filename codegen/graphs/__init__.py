"""What gets exported: each graph as a traceable function over flat arrays plus its contract.
The package's modules build the graphs (`kinds`: the registry export builds and verify rebuilds
through; `vision`, `model`: prefill and decode, with `decoder`: the text decoder's weights,
layer kinds and caches, and `ccl`: compute context lengths; `attention`); this module holds
what they share. Imports no other codegen package.

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
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np
from jax2onnx import onnx_function
from jax2onnx.plugins.plugin_system import PLUGIN_REGISTRY

from ref.blocking import for_phase
from ref.gemma4 import unified_config

# The repeated layers being exported: {function name: _Slot}, filled by the interceptor and read
# by the slot's layer function, which jax2onnx traces again after the call returns; so it
# lives for the whole export (`layer_scope`). One slot per distinct layer kind (the vision
# layer; each kind of text layer), each its own ONNX function, because the retrace sees only
# the slot's last module. "inside" stops re-interception.
_LAYER = contextvars.ContextVar("codegen_layer", default=None)
_INSIDE = contextvars.ContextVar("codegen_inside_layer", default=False)
# `layer_scope(once=True)`: {function name: jax.jit of the layer function}, so that a trace that
# reads only shapes and structure (the export's checks) traces each kind once, as jax2onnx does.
_ONCE = contextvars.ContextVar("codegen_layer_once", default=None)
# `layer_check(hook)`: who runs each routed layer applied without functions (verify's
# layer-by-layer check loads the layer's weights and compares with onnxruntime there).
_CHECK = contextvars.ContextVar("codegen_layer_check", default=None)


@contextlib.contextmanager
def layer_scope(once=False):
    """Hold the repeated layers' static descriptions while a graph is traced and lowered.

    once: call each layer kind's function through one `jax.jit` for the scope (a `pjit` per
    layer, one trace per kind, as its ONNX function is traced once) instead of tracing every
    layer again: for traces that only read shapes and structure (measured, E2B's 35 decoder
    layers at QEfficient's production blocking: the checks' JAX traces 12.1 s -> 4.7 s)."""
    token = _LAYER.set({})
    token_once = _ONCE.set({} if once else None)
    try:
        yield
    finally:
        _ONCE.reset(token_once)
        _LAYER.reset(token)


@contextlib.contextmanager
def layer_check(hook):
    """While active, each routed layer applied without functions returns
    `hook(module, kind, slot, arrays)` instead of `slot.apply(arrays + its params)`: module is
    the bound layer (its `path` names its weights), arrays its array arguments in function-input
    order (see `_Slot`)."""
    token = _CHECK.set(hook)
    try:
        yield
    finally:
        _CHECK.reset(token)


def eager_reference(plain, inputs, outputs, weights):
    """A GraphSpec's `reference` for a graph of one output: `plain(*inputs, *weights)` (the
    traceable function, layers inlined) on the feed and float32 weights → {output: numpy}."""

    def reference(feed, values):
        args = [feed[t.name] for t in inputs]
        out = plain(*args, *(jax.numpy.asarray(values[n], np.float32) for n in weights))
        return {outputs[0].name: np.asarray(out[0])}

    return reference


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


def folded_rows(cfg, kv_heads):
    """The specialization symbol of a batch-folded cache's rows ([1, rows·kv_heads, T, D]):
    "batch_kv_heads" for the first layer's head count, "batch_kv_heads_<n>" for another."""
    return "batch_kv_heads" if kv_heads == cfg.kv_heads[0] else f"batch_kv_heads_{kv_heads}"


def aligned_empty(shape, dtype, align=64):
    """An uninitialised array in a buffer aligned to `align` bytes: `jax.device_put` on CPU
    uses such a buffer in place instead of copying it (numpy's large arrays start 16 bytes
    into a page)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(size + align, np.uint8)
    start = -buf.ctypes.data % align
    return buf[start : start + size].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Drawn:
    """A sample input drawn only when read (`value`): standard normal float32 of `shape` from
    the generator seeded with `seed`, then `then(x)` if given (a storage format). A KV cache
    at QEfficient's production context (65,536 slots, 1 GiB per 31B full layer as float32) is
    drawn when its layer is reached, so a layer-by-layer check holds one layer's cache at a
    time; every reader gets the same values."""

    shape: tuple
    seed: tuple
    then: Callable | None = None
    dtype = np.dtype(np.float32)

    @property
    def ndim(self):
        return len(self.shape)

    def value(self):
        """The drawn array (a fresh, aligned one each call)."""
        out = aligned_empty(self.shape, self.dtype)
        np.random.default_rng(self.seed).standard_normal(out=out, dtype=self.dtype)
        return out if self.then is None else np.asarray(self.then(out), self.dtype)


@dataclasses.dataclass(frozen=True)
class Released:
    """Stands in for a result already compared and let go (a layer's new cache that no later
    step reads): shape and dtype only; reading it is an error."""

    shape: tuple
    dtype: np.dtype

    def value(self):
        raise GraphError(f"a released result {self.shape} was read again")


def drawn(x):
    """x, or its value when it is `Drawn` (a `Released` result raises)."""
    return x.value() if isinstance(x, (Drawn, Released)) else x


def drawn_feed(feed):
    """The sample `feed` with every `Drawn` input drawn."""
    return {n: drawn(x) for n, x in feed.items()}


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """One exported graph.

    fn(*inputs, *weights) → tuple of outputs (traced by jax2onnx with abstract weights);
    reference(inputs, weights) → dict of outputs (dicts keyed by name, numpy arrays);
    sample(symbols, rng) → dict of random inputs for one specialization (large ones may be
    `Drawn`, drawn when read: `drawn_feed` draws them all). static: the symbols
    bound at trace time to the first specialization's values (block bounds are compile-time),
    the graph's I/O then labelled with them; the other symbols stay symbolic in the trace.
    gathered: weights the reference reads only by row gathers (`ref.layers.Embedding`), so a
    layer-by-layer check may read them row by row. head: the weight the logits project onto
    (`ref.gemma4.step.Logits`), which such a check reads a slice of the vocabulary at a time.
    lazy: inputs the composition reads only as layer arguments, so such a check draws each
    (`Drawn`) when its layer is reached; every other `Drawn` input is drawn before it runs.
    constraints: what the trace may assume of the symbols left symbolic (`jax.export`'s
    constraint strings, e.g. "comp_ctx_lengths <= 4096": a slice to a symbolic end needs it).
    other_heads: further [V, D] weights the graph projects onto (the speculate graph's
    drafter head), which such a check also reads a slice of the vocabulary at a time.
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
    gathered: tuple = ()
    head: str | None = None
    lazy: tuple = ()
    constraints: tuple = ()
    other_heads: tuple = ()


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

    def outputs(self, arrays, results):
        """The layer's output tree from its inputs `arrays` (arguments, then parameters) and
        the distinct `results` the function made (`results` gives their out_map)."""
        leaves = [arrays[k] if src == "in" else results[k] for src, k in self.out_map]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)

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
    """A routed layer's distinct results (module from the slot `name` of `_LAYER`); the first
    trace of a kind in a scope records its outputs' tree and out_map in the slot, so the caller
    needs no trace of its own to rebuild them."""
    state = _LAYER.get()
    slot = state[name]
    distinct, out_map, tree = slot.results(arrays)
    if slot.out_tree is None:
        state[name] = dataclasses.replace(slot, out_tree=tree, out_map=out_map)
    return distinct


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
    return isinstance(leaf, (jax.Array, np.ndarray, Drawn))


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
            hook = _CHECK.get()
            return slot.apply(inputs) if hook is None else hook(module, name, slot, arrays)
        fn = globals()[layer_function(name)]
        once = _ONCE.get()
        if once is not None:
            if name not in once:  # a new function per scope: JAX shares traces across jits
                once[name] = jax.jit(functools.partial(fn))
            fn = once[name]
        made = fn(*inputs)
        if state[name].out_tree is None:  # the call reused a trace made before this scope
            jax.eval_shape(functools.partial(_layer_body, name), *inputs)  # records them
        return state[name].outputs(inputs, made)

    return interceptor


def blocking(name, options, *, prefill, batch, queries, kv_len):
    """A graph's BlockingConfig (None = dense) for a mode name as the CLI gives it, through
    `ref.blocking.for_phase` (the table of modes: defaults clipped to the sizes, aliases);
    GraphError names what is wrong."""
    try:
        return for_phase(
            name, dict(options or {}), prefill=prefill, batch=batch, queries=queries, kv_len=kv_len
        )
    except ValueError as e:
        raise GraphError(f"blocking {name!r} {dict(options or {})}: {e}") from e


def text_config(checkpoint_config):
    """The TextConfig of a Gemma 4 checkpoint (full VLM or text-only), None without one."""
    text = checkpoint_config.get("text_config", checkpoint_config)
    if not isinstance(text, dict) or "hidden_size" not in text or "vocab_size" not in text:
        return None
    try:
        return unified_config.any_text_config(checkpoint_config)
    except ValueError as e:
        raise GraphError(f"text_config: {e}") from e
