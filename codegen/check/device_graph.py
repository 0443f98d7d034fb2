"""The exported graph as the device computes it, in onnxruntime: `device_graph` (functions
inlined, every float tensor rounded to the compute format by a Cast pair but the node results a
node-precision plan keeps in float32, scalar statistics per tensor), its session, and the
first tensor that turned non-finite. `verify --precision` (`codegen.check.precision`), its
layer-by-layer form, the node-precision plan (`npi`) and `drift --plans` run it."""

import functools
import math
import os

import onnx
import onnx.inliner
from onnx import TensorProto, helper

from codegen.check import select_reads, weight_reads
from codegen.folder.sessions import session_at
from ref import numerics

_ONNX_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def layer_of(path):
    """The layer a module path belongs to: up to its first index ("encoder.layers.0"), else
    its first part ("patch_embedder", "VisionModel")."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def layer_peaks(records):
    """[(layer, largest |x|)] of `ref.numerics.Record`s, in order of first appearance; a
    tensor a plan keeps in float32 is not in the format's range, and not counted."""
    layers = {}
    for r in records:
        if not r.kept:
            key = layer_of(r.name)
            layers[key] = max(layers.get(key, 0.0), r.max_abs)
    return list(layers.items())


def float_tensors(model, inferred=None):
    """Names of the float32 tensors of an inlined model: its float inputs, then every node's
    float outputs in node order (types from ONNX shape inference: `inferred`, the model
    inferred, or inferred here)."""
    inferred = inferred or onnx.shape_inference.infer_shapes(model)
    typed = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    typed.update({v.name: v.type.tensor_type.elem_type for v in inferred.graph.output})
    inits = {i.name for i in model.graph.initializer}
    inputs = [
        v.name
        for v in model.graph.input
        if v.name not in inits and v.type.tensor_type.elem_type == TensorProto.FLOAT
    ]
    made = [o for n in model.graph.node for o in n.output if typed.get(o) == TensorProto.FLOAT]
    return inputs, made


def inline(model):
    """The model with its ONNX functions inlined. jax2onnx's functions import their own
    domain at version 18 where the model imports it at 1, which onnx's inliner refuses
    ("incompatible opset versions") or skips; the versions are aligned to the model's first."""
    versions = {o.domain: o.version for o in model.opset_import}
    for f in model.functions:
        for o in f.opset_import:
            o.version = versions.get(o.domain, o.version)
    return onnx.inliner.inline_local_functions(model)


STATS = ("hi", "lo", "l1", "fhi", "flo")  # per probed tensor: see `_stat_nodes`
FAST = ("hi", "lo", "sum")  # per probed tensor, read in place: its max, min and sum


def _stat_nodes(name, values=None):
    """Nodes making `name/hi`, `name/lo`, `name/l1` (the tensor's max, min and Σ|x|, read in
    place) and `name/fhi`, `name/flo` (the max and min of its finite values, its non-finite
    ones read as 0): float scalars, read by `stats_of` as the largest finite |x|, whether a
    NaN is there (Σ|x| is NaN then, and only then: its terms are ≥ 0 or +inf) and whether
    all are finite (no NaN, and max and min are exact then). One Where makes a tensor of its
    size (a masked tensor's −inf read as 0), three bool tensors beside it, where the earlier
    statistic (|x|, its finite part, its non-finite part) had two Wheres: onnxruntime's Where
    is its slowest op here (an E2B vision layer at 280 tokens with 52 tensors given full
    statistics: 2.24 s of Where in its 4.2 s, 0.53 s without them). values: the tensor to
    read them from (one holding name's values), name itself when None."""
    values = values or name

    def node(op, inputs, out, **attrs):
        ins = [i if i.startswith("stats/") or i == values else f"{name}/{i}" for i in inputs]
        return helper.make_node(op, ins, [f"{name}/{out}"], name=f"{name}/{out}", **attrs)

    return [
        node("IsInf", [values], "inf"),
        node("IsNaN", [values], "nan"),
        node("Or", ["inf", "nan"], "bad"),
        node("Where", ["bad", "stats/zero", values], "finite"),
        node("ReduceMax", ["finite"], "fhi", keepdims=0),
        node("ReduceMin", ["finite"], "flo", keepdims=0),
        *(node(op, [values], out, keepdims=0)
          for op, out in (("ReduceMax", "hi"), ("ReduceMin", "lo"), ("ReduceL1", "l1"))),
    ]  # fmt: skip


def _fast_stat_nodes(name, values=None):
    """Nodes making `name/hi`, `name/lo` and `name/sum` (its max, min and sum; an empty
    tensor's are −inf, inf and 0): three reductions that read the tensor in place, where
    `_stat_nodes` makes four of its size or of bools. They give `_stat_nodes`' answer whenever
    the tensor is finite (`stats_of`); most tensors of a run are (a layer's mask fill and
    the running maxima that start from it are not: their names are given full statistics).
    Measured on a 31B vision layer (2,520 patches) in the fp16 audit: 5.5 s a layer, where
    the earlier 12-node statistic on every tensor took 22 s and no statistics 3.3 s. values:
    as in `_stat_nodes`."""
    values = values or name
    return [
        helper.make_node(op, [values], [f"{name}/{out}"], name=f"{name}/{out}", keepdims=0)
        for op, out in (("ReduceMax", "hi"), ("ReduceMin", "lo"), ("ReduceSum", "sum"))
    ]


_MOVES = frozenset(
    {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Identity"}
)
# ops whose results are some of their operands' values, unchanged: {op: the inputs that carry
# those values (None: every input)}; the moves above carry their first
_SELECTS = {
    **{op: (0,) for op in _MOVES},
    "Where": (1, 2),
    "Max": None,
    "Min": None,
    "ReduceMax": (0,),
    "ReduceMin": (0,),
    "Slice": (0,),
    "Gather": (0,),
    "GatherElements": (0,),
    "GatherND": (0,),
    "Concat": None,
    "Split": (0,),
    "Tile": (0,),
}


def value_inputs(node):
    """The inputs of `node` whose values its results are made of (`_SELECTS`), or None when it
    computes new values."""
    if node.op_type not in _SELECTS:
        return None
    carried = _SELECTS[node.op_type]
    return [i for k, i in enumerate(node.input) if i and (carried is None or k in carried)]


def moves(model, inputs, made, keep):
    """The node results (of `made`) that only move, copy or select values already in the
    format: made by a Transpose, Reshape, … or a Where, Max, ReduceMax, Slice, Gather, …
    (`_SELECTS`) whose float operands are rounded (graph inputs, node results a plan does
    not keep, other such results), so the device's rounding of them changes nothing and
    their statistics are bounded by their operands' (their values are some of the operands'
    values: the largest |x| is no larger, and a non-finite value was one in an operand
    first): neither is added (a 31B layer's transposed weights were 2 GB rounded and read
    again; an E2B vision layer's masked score tiles at 10,080 patches, 0.5 GB each, took
    full statistics for their mask's −inf). A result of a kept or initializer value is
    rounded as any other."""
    keep = set(keep)
    rounded = set(inputs) | (set(made) - keep)
    floats = set(inputs) | set(made)
    floats |= {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    out = set()
    for node in model.graph.node:
        results = [o for o in node.output if o]
        if value_inputs(node) is None or not all(o in rounded for o in results):
            continue
        if all(i in rounded or i not in floats for i in node.input if i):
            out.update(results)
    return out


def device_graph(model, precision, keep=frozenset(), stats=True, full=frozenset()):
    """The exported graph as the device computes it: functions inlined, every float32 input
    and node result rounded to `precision` by a Cast pair — but the node results named in
    `keep` (a node-precision plan: QAIC's FP32NodeInstanceNames), which stay float32 — and
    scalar outputs per node result (read by `stats_of`): `_stat_nodes`' `name/peak`,
    `name/nonfinite` (stats True), `_fast_stat_nodes`' `name/hi`, `name/lo`, `name/sum`
    (stats "fast"; the names in `full` get `_stat_nodes`), or none (stats False: the graph's
    own outputs only). model: an onnx ModelProto (external data not loaded) → (ModelProto,
    probed tensor names in node order, the names of their scalar outputs)."""
    model = inline(model)
    inferred = onnx.shape_inference.infer_shapes(model)
    inputs, made = float_tensors(model, inferred)
    shapes, constants = select_reads.shapes(inferred), select_reads.scalars(model)
    moved = moves(model, inputs, made, keep)
    made = [n for n in made if n not in moved]
    to = _ONNX_TYPES[precision]
    graph = model.graph
    weights = weight_reads.weight_transposes(model, made, keep)
    renamed = {name: f"{name}/exact" for name in inputs}
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        node.output[:] = [f"{o}/exact" if o in made and o not in weights else o
                          for o in node.output]  # fmt: skip
        if node.op_type == "Transpose" and node.output[0] in weights:
            node.input[0] = weight_reads.source(node.output[0])
    nodes = list(graph.node)
    rounding = {t: weight_reads.rounded_weight(t, w, to) for t, w in weights.items()}
    keep = set(keep)
    for name in [n for n in made if n in keep]:
        rounding[name] = [helper.make_node("Identity", [f"{name}/exact"], [name],
                                           name=f"{name}/float32")]  # fmt: skip
    for name in [n for n in [*inputs, *made] if n not in rounding]:
        rounding[name] = [
            helper.make_node("Cast", [f"{name}/exact" if name in made else name], [f"{name}/low"],
                             to=to, name=f"{name}/to_low"),
            helper.make_node("Cast", [f"{name}/low"], [name if name in made else renamed[name]],
                             to=TensorProto.FLOAT, name=f"{name}/to_float"),
        ]  # fmt: skip
    ordered = [c for name in inputs for c in rounding[name]]

    def probes(name):
        if not stats:
            return []
        values = weight_reads.source(name) if name in weights else None
        if stats is True or name in full:
            return _stat_nodes(name, values)
        return _fast_stat_nodes(name, values)

    for node in nodes:
        weight = node.output[0] if node.op_type == "Transpose" else None
        if weight in weights:
            ordered += rounding[weight] + probes(weight)
        ordered.append(node)
        for o in node.output:
            if o.endswith("/exact"):
                ordered += rounding[o[:-6]] + probes(o[:-6])
    ordered = weight_reads.gemm_reads(ordered, {o.name for o in graph.output})
    types = {t.name: t.data_type for t in graph.initializer}
    ordered = weight_reads.narrowed_casts(ordered, types, to)
    ordered, bounds = select_reads.fast_selects(ordered, shapes, constants)
    graph.initializer.extend(bounds)
    del graph.node[:]
    graph.node.extend(at_first_use(ordered, {t.name for t in graph.initializer}))
    graph.initializer.extend(
        [
            helper.make_tensor("stats/zero", TensorProto.FLOAT, [], [0.0]),
        ]
    )
    outputs = [
        f"{n}/{stat}"
        for n in (made if stats else [])
        for stat in (STATS if stats is True or n in full else FAST)
    ]
    graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, []) for o in outputs)
    return model, made, outputs


def at_first_use(nodes, fixed):
    """`nodes` (in order) with each node that reads only `fixed` values (initializers) or what
    such nodes make — a weight's Cast and rounding pair, a Constant — moved to just before the
    first node that needs what it makes, and the nodes that only inspect such values (a
    weight's statistics) to just after what they read. onnxruntime runs the ready node listed
    first first (`PRIORITY_BASED`): listed at the top, a layer's weight Casts all ran before
    its first op, and every weight was held as float32 and rounded at once (31B prefill
    layer: 4.1 GB)."""
    ready, held = set(fixed), {}
    for node in nodes:
        if all(i in ready for i in node.input if i):
            ready.update(node.output)
            held.update({o: node for o in node.output})
    ready -= set(held)
    later = {id(n) for n in held.values()}
    needed, stack = set(), [i for n in nodes if id(n) not in later for i in n.input]
    while stack:
        node = held.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack += node.input
    readers = {}
    for node in nodes:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    out, done = [], set()

    def emit(node):
        for i in node.input:
            if i in held and i not in ready:
                emit(held[i])
        done.add(id(node))
        out.append(node)
        ready.update(node.output)
        for r in [r for o in node.output for r in readers.get(o, [])]:
            inspects = id(r) in later and id(r) not in needed
            if inspects and id(r) not in done and all(i in ready for i in r.input if i):
                emit(r)

    for node in nodes:
        if id(node) in done or id(node) in needed:
            continue
        if id(node) not in later or all(i in ready for i in node.input if i):
            emit(node)
    return out


def stats_of(got, names):
    """{name: (largest finite |x|, any NaN, all finite)} from a device graph's scalar
    outputs `got` ({output name: value}): a tensor's `_stat_nodes` outputs where it has them,
    else its "fast" ones, which answer exactly for a tensor whose max, min and sum are finite
    (the sum: a NaN anywhere makes it NaN, where onnxruntime's ReduceMax and ReduceMin skip
    NaNs). Any other tensor (an inf or a NaN is there, or a float32 tensor's sum overflowed)
    needs `_stat_nodes`: `Inexact` is raised naming every such tensor."""
    out, inexact = {}, []
    for n in names:
        hi, lo = float(got[f"{n}/hi"]), float(got[f"{n}/lo"])
        if f"{n}/fhi" in got:
            nan = math.isnan(float(got[f"{n}/l1"]))
            peak = max(float(got[f"{n}/fhi"]), -float(got[f"{n}/flo"]), 0.0)
            out[n] = (peak, nan, not nan and hi != math.inf and lo != -math.inf)
            continue
        total = float(got[f"{n}/sum"])
        if math.isfinite(total) and hi != math.inf and lo != -math.inf:
            out[n] = (max(hi, -lo, 0.0), False, True)
        else:
            inexact.append(n)
    if inexact:
        raise Inexact(inexact)
    return out


class Inexact(Exception):
    """Raised by `stats_of` for tensors whose fast statistics cannot answer (`.names`)."""

    def __init__(self, names):
        super().__init__(f"{len(names)} tensor(s) need full statistics, first {names[0]!r}")
        self.names = names


def device_session(model, entry, folder, precision, keep=frozenset()):
    """(onnxruntime session, probed names) of `device_graph` of an exported graph (`model`, its
    ModelProto as loaded, external data not); the rewritten file sits in the folder (its
    external data paths are relative) while loading."""
    model, names, _ = device_graph(model, precision, keep)
    path = os.path.join(folder, f".precision.{entry.name}.onnx")
    return session_at(model, path), names


def first_nonfinite_onnx(stats, names, producers):
    """The first probed tensor (node order) that turned non-finite — NaN anywhere, or inf made
    from finite inputs — as "name (Op of input, …)", or None. stats: {name: (peak, any NaN,
    all finite)} (`stats_of`; inputs may be among them); producers: {name: the node that
    makes it}."""
    name = first_nonfinite_name(stats, names, producers)
    if name is None:
        return None
    node = producers[name]
    return f"{name!r} ({node.op_type} of {', '.join(repr(i) for i in node.input)})"


def first_nonfinite_name(stats, names, producers):
    """The name `first_nonfinite_onnx` describes, or None."""
    finite = {n: st[2] for n, st in stats.items()}
    seen = _finite_or_moved(finite, producers)
    readers = {}
    for node in {id(n): n for n in producers.values()}.values():
        for i in node.input:
            readers.setdefault(i, []).append(node.op_type)
    for name in names:
        node = producers[name]
        # an inf read only by Clips (`export --clip-fp16`) is clamped before it spreads; a
        # Constant beyond the range (a float32 mask fill) is an input, as ref's literals are
        clamped = readers.get(name) and set(readers[name]) == {"Clip"}
        nan = stats[name][1]
        if node.op_type == "Constant" and not nan:
            continue
        if nan or (not finite[name] and not clamped and all(seen(i) for i in node.input)):
            return name
    return None


def _finite_or_moved(finite, producers):
    """seen(name): whether the tensor `name` is all finite as far as the statistics tell — a
    `moves` result (not probed) as the operands whose values it carries (`value_inputs`), an
    unprobed value as finite."""

    def seen(name):
        if name in finite:
            return finite[name]
        node = producers.get(name)
        carried = None if node is None else value_inputs(node)
        return carried is None or all(seen(i) for i in carried)

    return functools.cache(seen)


def formats(precision, kv_dtype):
    """(compute format, KV storage format or None), their canonical names (`fp16` → float16)."""
    kv = None if kv_dtype is None else numerics.format_name(kv_dtype, numerics.KV_FORMATS)
    return numerics.format_name(precision), kv
