"""Checks every written graph must pass; each raises `CheckError` naming what is wrong.

- `checker`: onnx.checker's full check (strict shape inference included) with external
  initializers seen as typed graph inputs: onnx refuses external data in a hard-linked file
  ("hardlink attack"), and hard links are the point; `external_paths` checks them instead.
- `external_paths`: every external-data location is a plain file name inside the output
  folder (onnxruntime refuses anything else) and its byte range fits the file.
- `allowed_ops`: the graph and its functions stay inside `codegen.lower.ops.ALLOWED_OPS`.
- `inferred_shapes`: at each specialization, ONNX shape inference gives the output shapes the
  `ref` function gives (jax2onnx can declare a wrong shape, e.g. for a concatenation along a
  symbolic axis).
- `no_unclamped_dynamic_slice`: jax2onnx lowers `lax.dynamic_slice` without the clamping JAX
  applies to an out-of-range start, so a traced start is refused (a literal one is fine).
"""

import copy
import os

import jax
import onnx
from jax._src import source_info_util
from jax._src.export.shape_poly import UnexpectedDimVar
from jax.extend.core import Literal
from onnx import shape_inference

from codegen.lower.ops import ALLOWED_OPS
from codegen.lower.trace import symbols, traced_args


class CheckError(ValueError):
    """A written graph fails a check."""


def _without_external(model):
    """A copy whose external initializers are graph inputs of the same type and shape."""
    m = copy.deepcopy(model)
    keep, moved = [], []
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            moved.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    m.graph.input.extend(moved)
    return m


def checker(model):
    """onnx.checker full check of a ModelProto (its external data stays on disk)."""
    try:
        onnx.checker.check_model(_without_external(model), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise CheckError(f"{model.graph.name}: onnx.checker: {e}") from e


def _initializers(model):
    yield from model.graph.initializer
    for node in _nodes(model):
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t


def external_paths(model, folder):
    """External data of every tensor: a file inside `folder` (subfolders allowed, no link
    leading out), range within the file."""
    root = os.path.realpath(folder)
    for t in _initializers(model):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = {e.key: e.value for e in t.external_data}
        loc = entry.get("location", "")
        where = os.path.realpath(os.path.join(root, loc))
        inside = os.path.commonpath([where, root]) == root and where != root
        if os.path.isabs(loc) or os.path.normpath(loc) != loc or not inside:
            raise CheckError(f"tensor {t.name!r}: external data {loc!r} leaves the output folder")
        if os.path.islink(os.path.join(root, loc)) or not os.path.isfile(where):
            raise CheckError(f"tensor {t.name!r}: external data {loc!r} is not a regular file")
        end = int(entry.get("offset", 0)) + int(entry.get("length", 0))
        if end > os.path.getsize(where):
            raise CheckError(
                f"tensor {t.name!r}: bytes up to {end} but {loc!r} has {os.path.getsize(where)}"
            )


def _nodes(model):
    """Every node: the graph's, its functions', and their subgraphs'."""
    stack = [list(model.graph.node)] + [list(f.node) for f in model.functions]
    while stack:
        for node in stack.pop():
            yield node
            for attr in node.attribute:
                if attr.HasField("g"):
                    stack.append(list(attr.g.node))
                stack.extend(list(g.node) for g in attr.graphs)


def allowed_ops(model):
    """Standard ops must be on the allow-list; other domains must be the model's functions."""
    functions = {(f.domain, f.name) for f in model.functions}
    bad = set()
    for node in _nodes(model):
        if node.domain in ("", "ai.onnx"):
            if node.op_type not in ALLOWED_OPS:
                bad.add(node.op_type)
        elif (node.domain, node.op_type) not in functions:
            bad.add(f"{node.domain}.{node.op_type}")
    if bad:
        raise CheckError(
            f"ops outside the allow-list (codegen/lower/ops.py): {sorted(bad)}; rewrite the "
            "ref function or, after checking the QAIC SDK's list, extend the allow-list"
        )


def _concrete(model, spec, symbols):
    """A shape-only copy of `model` with every input dim bound to the specialization."""
    m = copy.deepcopy(model)
    del m.graph.value_info[:]
    shapes = {t.name: t.concrete(symbols) for t in spec.inputs}
    for value in m.graph.input:
        if value.name not in shapes:
            continue
        dims = value.type.tensor_type.shape.dim
        for dim, size in zip(dims, shapes[value.name], strict=True):
            dim.Clear()
            dim.dim_value = size
    for value in m.graph.output:
        value.type.tensor_type.ClearField("shape")
    # data propagation would read an integer initializer's bytes (the assistant's
    # token_ordering): its shape is all inference needs, as an input's
    ints = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    held = [t for t in m.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL and t.data_type in ints]  # fmt: skip
    for t in held:
        m.graph.initializer.remove(t)
        m.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    return m


def ref_trace(spec, weight_shapes):
    """`spec.fn` (the `ref` composition) as a ClosedJaxpr, traced as `codegen.lower.trace.trace`
    traces it (static symbols bound to the first specialization, the others symbolic, int64
    inputs as int32, x64 off), each layer kind once; weight_shapes: {checkpoint name: shape}."""
    from codegen.graphs import layer_scope

    args = traced_args(spec, weight_shapes, symbols(spec, every=True))
    with jax.enable_x64(False), layer_scope(once=True):
        return jax.make_jaxpr(spec.fn)(*args)


def ref_shapes(spec, closed):
    """{specialization name: {output name: shape}} that `ref` gives, from its one symbolic trace
    `closed` (`ref_trace`), each output dim evaluated at the specialization's symbols."""
    return {
        s["name"]: {
            t.name: tuple(_at(d, s["symbols"], spec, t) for d in aval.shape)
            for t, aval in zip(spec.outputs, closed.out_avals, strict=True)
        }
        for s in spec.specializations
    }


def _at(dim, symbols, spec, tensor):
    """A dim of the symbolic trace (an int or an expression of the symbols) at `symbols`."""
    if isinstance(dim, int):
        return dim
    try:  # JAX's own evaluation of its expressions (jax pinned at 0.10 by jax2onnx)
        return int(dim._evaluate(symbols))
    except (KeyError, UnexpectedDimVar) as e:
        raise CheckError(
            f"{spec.name}: ref gives output {tensor.name!r} the dim {dim}: expected an "
            f"expression of the specialization's symbols {sorted(symbols)}"
        ) from e


def _dims(value, symbols=None):
    """A ValueInfo's shape: ints, with dim_params bound by `symbols` where they can be."""
    symbols = symbols or {}
    return tuple(
        d.dim_value if d.HasField("dim_value") else symbols.get(d.dim_param, d.dim_param or None)
        for d in value.type.tensor_type.shape.dim
    )


def inferred_shapes(model, spec, want):
    """At every specialization, each output's shape as the graph declares it, as ONNX shape
    inference derives it, and as the spec declares it all equal `want`: {specialization name:
    {output name: shape}} that `ref` gives (`no_unclamped_dynamic_slice`, `ref_shapes`)."""
    declared_by_graph = {o.name: o for o in model.graph.output}
    for s in spec.specializations:
        symbols = s["symbols"]
        try:
            inferred = shape_inference.infer_shapes(
                _concrete(model, spec, symbols), check_type=True, strict_mode=True, data_prop=True
            )
        except onnx.shape_inference.InferenceError as e:
            raise CheckError(f"{spec.name} at {s['name']}: shape inference failed: {e}") from e
        got = {o.name: _dims(o) for o in inferred.graph.output}
        for t in spec.outputs:
            ref = want[s["name"]][t.name]
            shapes = {
                "graph declares": _dims(declared_by_graph[t.name], symbols),
                "inference gives": got.get(t.name),
                "spec declares": t.concrete(symbols),
            }
            wrong = {k: v for k, v in shapes.items() if v != ref}
            if wrong:
                raise CheckError(
                    f"{spec.name} at {s['name']}: output {t.name!r}: ref gives {ref}, "
                    + ", ".join(f"{k} {v}" for k, v in wrong.items())
                )


_SLICES = ("dynamic_slice", "dynamic_update_slice")


def _dynamic_slices(jaxpr, seen=None):
    """(eqn) of each dynamic_slice / dynamic_update_slice whose start depends on an input of
    its jaxpr (a sub-jaxpr's inputs all count as run-time values, so a sub-jaxpr that many
    equations share, a jitted layer or block function, is looked at once)."""
    seen = set() if seen is None else seen
    dynamic = set(jaxpr.invars) | set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        ins = [v for v in eqn.invars if not isinstance(v, Literal)]
        if eqn.primitive.name in _SLICES:
            first = 2 if eqn.primitive.name == "dynamic_update_slice" else 1
            if any(v in dynamic for v in eqn.invars[first:] if not isinstance(v, Literal)):
                yield eqn
        if any(v in dynamic for v in ins):
            dynamic.update(eqn.outvars)
    for eqn in jaxpr.eqns:
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and id(inner) not in seen:
                    seen.add(id(inner))
                    yield from _dynamic_slices(inner, seen)


def no_unclamped_dynamic_slice(spec, weight_shapes):
    """Refuse a `dynamic_slice`/`dynamic_update_slice` whose start is computed at run time
    (a start folded from constants is fine), in the trace of `ref` the export lowers
    (`ref_trace`). → `ref_shapes` of that trace: the output shapes at every specialization."""
    closed = ref_trace(spec, weight_shapes)
    for eqn in _dynamic_slices(closed.jaxpr):
        where = source_info_util.summarize(eqn.source_info)
        raise CheckError(
            f"{spec.name}: {eqn.primitive.name} with a run-time start at {where}: "
            "jax2onnx does not clamp it as JAX does; use a static slice or a gather"
        )
    return ref_shapes(spec, closed)
