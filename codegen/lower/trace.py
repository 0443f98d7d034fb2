"""Tracing a GraphSpec into an ONNX ModelProto with jax2onnx, weights as abstract inputs.

No weight is materialized: every weight is a `jax.ShapeDtypeStruct`. Symbols named in the
spec's `static` are bound to the first specialization's values at trace time (block bounds
are compile-time constants); the graph's inputs and outputs are labelled with them afterwards.
"""

import collections
import contextlib
import dataclasses
import importlib
import logging
import types
from pathlib import Path

import jax
import numpy as np
import onnx
import onnx_ir as ir
from jax import export as jax_export
from jax import lax
from jax2onnx import to_onnx
from jax2onnx.converter import (
    conv_transpose_bias_folding,
    ir_optimizations,
    optimizer_graph_utils,
    output_binding,
)
from jax2onnx.plugins import _ir_shapes, plugin_system
from jax2onnx.plugins._patching import MonkeyPatchSpec

from codegen import graphs
from codegen.lower.ops import OPSET


def _load_jax_plugins():
    """Register jax2onnx's plugins for JAX primitives only (1-2 s), before its first call.

    Left alone, the first `to_onnx` imports every plugin tree, examples included, and those
    compile Equinox models at import: 10-20 s of a 2-core machine. `ref` is plain JAX (Linen
    modules only compose jnp functions), so the JAX primitive plugins are all it needs.
    """
    if plugin_system._already_imported_plugins:
        return
    root = Path(plugin_system.__file__).parent
    plugin_system._import_tree(root / "jax", "jax2onnx.plugins.jax")
    plugin_system._already_imported_plugins = True


@contextlib.contextmanager
def _quiet_onnx_ir():
    """onnx_ir logs a warning per shape-only constant it serializes ("value type ... not
    known"): dozens per graph, none actionable. Keep its errors."""
    logger = logging.getLogger("onnx_ir")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _shared_symbolic_scope():
    """jax2onnx's gather lowering deep-copies its parameters, symbolic sizes included, and JAX
    deep-copies their SymbolicScope too: once the scope has cached bounds of expressions such as
    `floordiv(num_patches, 9)` (the vision graph's tiles), the half-built copy fails
    (AttributeError: no `_normalization_rules`). A copied dimension must keep its scope anyway
    (dimensions of two scopes cannot be compared), so while tracing a copy shares it."""
    cls = jax_export.SymbolicScope
    old = cls.__dict__.get("__deepcopy__")
    cls.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if old is None:
            del cls.__deepcopy__
        else:
            cls.__deepcopy__ = old


def _connected_newest_first(ctx, value):
    """jax2onnx's `_value_is_graph_connected` with the same answer, found from the other end.

    After each equation jax2onnx asks, per output, whether its value is a graph input, an
    initializer or the output of any node so far (by identity or name), scanning the nodes from
    the first: quadratic in the graph's size, and most of a trace's time (measured: 8.6 M name
    reads for a tiny model's three graphs). The value is almost always the output of a node
    just added, so the same `any` over the nodes newest first ends at once. A value the graph
    owns (a node's output, an input, an initializer: onnx_ir records its graph) is connected at
    once; the scan is for the rest (a constant's value bound once per cache with
    --full-batch-size went through every node)."""
    match = output_binding._value_matches_reference
    builder = ctx.builder
    graph = builder.nodes
    producer = value.producer()
    if producer is not None and producer.graph is graph:
        return True
    if (value.is_graph_input() or value.is_initializer()) and value.graph is graph:
        return True
    return (
        any(match(out, value) for node in reversed(builder.nodes) for out in node.outputs)
        or any(match(x, value) for x in builder.inputs)
        or any(match(x, value) for x in builder.initializers)
    )


@contextlib.contextmanager
def _newest_first_connectivity():
    old = output_binding._value_is_graph_connected
    output_binding._value_is_graph_connected = _connected_newest_first
    try:
        yield
    finally:
        output_binding._value_is_graph_connected = old


def _producer_by_identity(nodes, value_or_name):
    """jax2onnx's `optimizer_graph_utils._producer_node` with the same answer, without building
    a set of every node's id at each call (its optimizer asks once per candidate value: 2,433
    calls over ~5,000-node layer functions of a blocked 31B prefill, 2-3 s of its export). A
    value's producer counts when it is one of `nodes`; else, as there, the first node with an
    output of that value or name."""
    if value_or_name is None:
        return None
    if isinstance(value_or_name, ir.Value):
        prod = value_or_name.producer()
        # ir.Node compares by identity, so `in` is the identity test, at C speed
        if isinstance(prod, ir.Node) and prod in nodes:
            return prod
    ref_value, target = optimizer_graph_utils._value_identity(value_or_name)
    if target is None and isinstance(value_or_name, ir.Value):
        target = optimizer_graph_utils._v_name(value_or_name)
    for node in nodes:
        for out in optimizer_graph_utils._node_outputs(node):
            if ref_value is not None and out is ref_value:
                return node
            if target and optimizer_graph_utils._v_name(out) == target:
                return node
    return None


def _consumers_by_identity(original):
    """jax2onnx's `optimizer_graph_utils._consumer_nodes` with the same answer, without building
    a set of every node's id at each call (its Cast pass asks once per Cast: ~1 s of a 31B
    --full-batch-size export): a consumer counts when it is one of `nodes` (`in` on the list is
    the identity test, at C speed); else, as there, its name-based scan."""

    def consumers(nodes, value_or_name):
        if isinstance(value_or_name, ir.Value) and isinstance(nodes, list):
            found = value_or_name.consumers()
            if found and all(isinstance(c, ir.Node) for c in found):
                mine = [c for c in found if c in nodes]
                if mine:
                    return mine
        return original(nodes, value_or_name)

    return consumers


@contextlib.contextmanager
def _producers_by_identity():
    modules = (optimizer_graph_utils, ir_optimizations, conv_transpose_bias_folding)
    old = [m._producer_node for m in modules]
    old_consumers = optimizer_graph_utils._consumer_nodes
    for m in modules:
        m._producer_node = _producer_by_identity
    for m in modules[:2]:
        m._consumer_nodes = _consumers_by_identity(old_consumers)
    try:
        yield
    finally:
        for m, fn in zip(modules, old, strict=True):
            m._producer_node = fn
        for m in modules[:2]:
            m._consumer_nodes = old_consumers


def _numpy_tensor(tensor):
    """`onnx_ir.tensor` with a fast path for a numpy array: `ir.Tensor(value, ...)`, which is
    what `tensor` returns for one after three `isinstance` checks against runtime Protocols
    (Python 3.11 collects a Protocol's members again at each check: ~1 s of an E2B export)."""

    def fast(value, dtype=None, name=None, doc_string=None):
        if type(value) is np.ndarray:
            return ir.Tensor(value, dtype=dtype, name=name, doc_string=doc_string)
        return tensor(value, dtype=dtype, name=name, doc_string=doc_string)

    return fast


@contextlib.contextmanager
def _fast_numpy_tensors():
    old = ir.tensor
    ir.tensor = _numpy_tensor(old)
    try:
        yield
    finally:
        ir.tensor = old


# jax2onnx's plugins patched below for sizes left symbolic (the language program's seq_len and
# batch_size): each patch leaves a statically sized trace as it was
_CONCATENATE = importlib.import_module("jax2onnx.plugins.jax.numpy.concatenate")
_REM = importlib.import_module("jax2onnx.plugins.jax.lax.rem")
_FULL = importlib.import_module("jax2onnx.plugins.jax.numpy.full")


@contextlib.contextmanager
def _concatenated_symbolic_sizes():
    """jax2onnx replaces `jnp.concatenate` with a primitive whose shape rule sums the sizes
    along the axis only when all are ints, and else declares the first operand's: a ring of 8
    slots joined to seq_len new keys was declared [.., 8, ..], and a broadcast of it baked 8
    into a Reshape that then failed on 8 + seq_len keys. The sum instead."""
    cls = _CONCATENATE.JnpConcatenatePlugin
    old = cls.__dict__["abstract_eval"]

    def abstract_eval(*arrays, dimension=0, axis=None):
        out = old.__func__(*arrays, dimension=dimension, axis=axis)
        at = _CONCATENATE._normalize_axis(dimension if axis is None else axis, len(out.shape))
        shape = list(out.shape)
        shape[at] = sum(a.shape[at] for a in arrays)
        return out.update(shape=tuple(shape))

    cls.abstract_eval = staticmethod(abstract_eval)
    cls._PRIM.def_abstract_eval(abstract_eval)  # the primitive holds the rule it was given
    try:
        yield
    finally:
        cls.abstract_eval = old
        cls._PRIM.def_abstract_eval(old.__func__)


@contextlib.contextmanager
def _rem_symbolic_shapes():
    """jax2onnx's `lax.rem` lowering stamps `ir.Shape(aval.shape)` itself, before its usual
    labelling, and onnx_ir calls int() on a symbolic size ("Symbolic dimension 'seq_len' used
    in a context that requires a constant", at `positions % window`). Its `ir.Shape` labels
    the sizes first, as that labelling does next."""
    shim = types.SimpleNamespace(**{n: getattr(ir, n) for n in dir(ir) if not n.startswith("__")})
    shim.Shape = lambda dims, *a, **k: ir.Shape(
        [_ir_shapes._to_ir_dim_for_shape(d) for d in dims], *a, **k
    )
    old = _REM.ir
    _REM.ir = shim
    try:
        yield
    finally:
        _REM.ir = old


def _full_of(patched):
    """jax2onnx's `jnp.full` for static shapes; a shape with a symbolic size (int() of each
    size fails there) goes to `lax.full`, a broadcast of the fill value."""

    def full(shape, fill_value, dtype=None, **kw):
        dims = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        if kw or all(isinstance(d, (int, np.integer)) for d in dims):
            return patched(shape, fill_value, dtype, **kw)
        return lax.full(dims, fill_value, dtype)

    return full


@contextlib.contextmanager
def _symbolic_full():
    """`jnp.full` through `_full_of` while tracing."""
    cls = _FULL.JnpFullPlugin
    old = cls.__dict__["binding_specs"]

    def specs(owner):
        return [
            dataclasses.replace(s, make_value=lambda orig, make=s.make_value: _full_of(make(orig)))
            if isinstance(s, MonkeyPatchSpec) and s.attr == "full"
            else s
            for s in old.__func__(owner)
        ]

    cls.binding_specs = classmethod(specs)
    try:
        yield
    finally:
        cls.binding_specs = old


def symbols(spec, every=False):
    """{symbol: its dimension} for the symbols the trace leaves symbolic, made in one scope
    with the spec's constraints (a plain string symbol knows none: "comparison 'n' <= '64' is
    inconclusive" at a slice to it); without constraints {} (jax2onnx makes them from their
    names) unless `every` (a trace outside jax2onnx needs them made)."""
    if not (spec.constraints or every):
        return {}
    names = sorted(
        {d for t in spec.inputs for d in t.shape if isinstance(d, str)} - set(spec.static)
    )
    if not names:
        return {}
    dims = jax_export.symbolic_shape(",".join(names), constraints=spec.constraints)
    return dict(zip(names, dims, strict=True))


def trace_dtype(dtype):
    """The dtype an input is traced in: int64 as int32 (the trace runs without x64; an int64
    input is relabelled afterwards, `_label_symbols`)."""
    return "int32" if dtype == "int64" else dtype


def traced_args(spec, weight_shapes, dims):
    """jax.ShapeDtypeStruct of each input then each weight as the trace takes them: static
    symbols bound to the first specialization's values, the others `dims` (`symbols`) or their
    names; weight_shapes: {checkpoint name: shape}."""
    first = spec.specializations[0]["symbols"]
    bound = {k: v for k, v in first.items() if k in spec.static} | dims
    args = [
        jax.ShapeDtypeStruct(tuple(bound.get(d, d) for d in t.shape), trace_dtype(t.dtype))
        for t in spec.inputs
    ]
    return args + [jax.ShapeDtypeStruct(tuple(weight_shapes[n]), "float32") for n in spec.weights]


def trace(spec, tensors):
    """ONNX ModelProto of `spec.fn` with weights as float32 graph inputs (none materialized)."""
    args = traced_args(spec, {n: t.shape for n, t in tensors.items()}, symbols(spec))
    _load_jax_plugins()
    with (
        jax.enable_x64(False),
        graphs.layer_scope(),
        _quiet_onnx_ir(),
        _shared_symbolic_scope(),
        _newest_first_connectivity(),
        _producers_by_identity(),
        _fast_numpy_tensors(),
        _concatenated_symbolic_sizes(),
        _rem_symbolic_shapes(),
        _symbolic_full(),
    ):
        model = to_onnx(
            spec.fn,
            args,
            model_name=spec.name,
            opset=OPSET,
            input_names=[t.name for t in spec.inputs] + list(spec.weights),
            output_names=[t.name for t in spec.outputs],
        )
    if spec.static or any(t.dtype == "int64" for t in spec.inputs):
        _label_symbols(model, spec)
    scope_function_values(model)
    return model


def scope_function_values(model):
    """Name every value a function body makes `FUNCTION/name`, in place. jax2onnx names a body's
    values as it names the top level's (`add_out_0` in every layer function and at the top):
    a node-precision plan compiled with `-sub-functions` names a body's node by its body name
    (QEfficient's `generate_npi_file`), and only a name no other scope holds says which node
    it keeps. Raises ValueError where a name is still made twice (two functions of one
    name), or a body holds a subgraph (which would read the old names)."""
    for f in model.functions:
        if any(a.HasField("g") or a.graphs for n in f.node for a in n.attribute):
            raise ValueError(f"function {f.name!r} holds a subgraph: expected none")
        scoped = {o: f"{f.name}/{o}" for n in f.node for o in n.output if o}
        for node in f.node:
            node.input[:] = [scoped.get(i, i) for i in node.input]
            node.output[:] = [scoped.get(o, o) for o in node.output]
        f.output[:] = [scoped.get(o, o) for o in f.output]
        for value in f.value_info:
            value.name = scoped.get(value.name, value.name)
    made = [o for n in model.graph.node for o in n.output if o]
    made += [o for f in model.functions for n in f.node for o in n.output if o]
    twice = sorted(o for o, k in collections.Counter(made).items() if k > 1)
    if twice:
        raise ValueError(f"values made in more than one scope: {twice[:5]}; expected one "
                         "function of each name")  # fmt: skip


def _label_symbols(model, spec):
    """Give a statically traced graph's I/O the symbols its specialization binds, and an int64
    input (traced as int32, `trace_dtype`; read for its shape only) its declared type."""
    declared = {t.name: t.shape for t in spec.inputs + spec.outputs}
    int64 = {t.name for t in spec.inputs if t.dtype == "int64"}
    for value in list(model.graph.input) + list(model.graph.output):
        shape = declared.get(value.name)
        if shape is None:
            continue
        if value.name in int64:
            value.type.tensor_type.elem_type = onnx.TensorProto.INT64
        for dim, want in zip(value.type.tensor_type.shape.dim, shape, strict=True):
            if isinstance(want, str):
                dim.Clear()
                dim.dim_param = want
