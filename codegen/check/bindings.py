"""The proof behind `verify` by layer function (`codegen.check.by_function`): from the graph and
the checkpoint's headers alone (no weight byte read), every layer call binds what `ref`'s
composition binds.

Both sides are read as a list of layer calls, each input named by where it comes from
(`Source`): a graph input by name, a checkpoint weight by name, a result of an earlier call
(call, result index), or glue (a value the graph computes between calls). `ref`'s side is
its composition traced once (`structure.ref_trace`: each layer call a `jit` equation named
after its function); the graph's side its top-level nodes. Then, call by call and input by
input (`faults`):

- a weight: the graph's initializer (through its widening Cast, if any) is external data at
  exactly the checkpoint tensor `ref` binds there: the same name, element type, shape, file,
  offset and length as the safetensors header says;
- a graph input or an earlier call's result: the same one;
- glue: the same graph inputs, weights and call results feed it on both sides (its
  `frontier`), and one glue value of `ref` is one value of the graph across every call (a
  sliding call given the full calls' mask is a second `ref` value on one graph value);
- calls of one function have the same domain, arity and attributes, and each weight is
  widened the same way in every call.

The graph's outputs are matched the same way (a layer's retained cache is its own call's
result). What a call computes is the function's body, one per kind, checked numerically on
one call (`by_function`).
"""

import dataclasses

import onnx
from jax.extend.core import Literal

from codegen.check.structure import ref_trace
from codegen.check.supplied_weights import Supplier

LAYER_PREFIX = "layer_fn_"  # `codegen.graphs.layer_function`'s names
SHAPE_OPS = ("Shape", "Size")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a value comes from: kind "input" (key: graph input name), "weight" (checkpoint
    name), "call" ((call index, result index)), "glue" (a key of its side: one per value),
    "const" (a value fixed by the graph alone: no inputs, no weights)."""

    kind: str
    key: object


@dataclasses.dataclass
class Calls:
    """One side's layer calls: per call (function name, [Source per input], attributes), the
    graph outputs' Sources in order, and each glue value's frontier (the inputs, weights and
    call results it is computed from, through glue only)."""

    calls: list
    outputs: list
    frontier: dict


def _union(sets):
    out = set()
    for s in sets:
        out |= s
    return frozenset(out)


def ref_calls(spec, shapes):
    """`Calls` of `spec` (built with layer functions) from its `ref` trace; shapes: {checkpoint
    name: shape}. A weight read through a dtype conversion is still that weight."""
    jaxpr = ref_trace(spec, shapes).jaxpr
    names = [("input", t.name) for t in spec.inputs] + [("weight", n) for n in spec.weights]
    where = {v: Source(*s) for v, s in zip(jaxpr.invars, names, strict=True)}
    where.update({v: Source("const", None) for v in jaxpr.constvars})  # arrays the trace holds
    frontier, calls = {}, []

    def source(v):
        if isinstance(v, Literal):
            return Source("const", None)
        return where[v]

    def reach(s):
        if s.kind == "glue":
            return frontier[s.key]
        return frozenset() if s.kind == "const" else frozenset({s})

    for eqn in jaxpr.eqns:
        name = str(eqn.params.get("name", "")) if eqn.primitive.name in ("jit", "pjit") else ""
        ins = [source(v) for v in eqn.invars]
        if name.startswith(LAYER_PREFIX):
            k = len(calls)
            calls.append((name[len(LAYER_PREFIX) :], ins, ()))
            where.update({v: Source("call", (k, r)) for r, v in enumerate(eqn.outvars)})
            continue
        if eqn.primitive.name == "convert_element_type" and ins[0].kind == "weight":
            where[eqn.outvars[0]] = ins[0]
            continue
        reached = _union(reach(s) for s in ins)
        for v in eqn.outvars:
            where[v] = Source("glue", id(v)) if reached else Source("const", None)
            if reached:
                frontier[id(v)] = reached
    outputs = [source(v) for v in jaxpr.outvars]
    return Calls(calls, outputs, frontier)


def _checkpoint_names(model, folder, checkpoint):
    """{initializer name: checkpoint name} of the graph's initializers that are external data
    at a checkpoint tensor's exact bytes (`Supplier.checkpoint_name`: headers only)."""
    supplier = Supplier(folder, checkpoint)
    named = {t.name: supplier.checkpoint_name(t) for t in model.graph.initializer}
    return {t: n for t, n in named.items() if n is not None}


def graph_calls(model, folder, checkpoint):
    """`Calls` of the ONNX graph `model` of the export in `folder` (top-level nodes; a node
    calling one of the model's functions is a layer call). A weight is an initializer that is
    external data at a checkpoint tensor's bytes (found by the checkpoint's headers), or its
    widening Cast; its Source key is the initializer's own name (`faults` checks it)."""
    graph = model.graph
    functions = {(f.domain, f.name) for f in model.functions}
    held = _checkpoint_names(model, folder, checkpoint)
    where = {i.name: Source("input", i.name) for i in graph.input}
    for t in graph.initializer:
        external = t.data_location == onnx.TensorProto.EXTERNAL
        where[t.name] = Source("weight", t.name) if external else Source("const", None)
    frontier, calls = {}, []

    def reach(s):
        if s.kind == "glue":
            return frontier[s.key]
        if s.kind == "weight":
            init = _weight(s.key)[0]
            return frozenset({Source("weight", held.get(init, init))})
        return frozenset() if s.kind == "const" else frozenset({s})

    for node in graph.node:
        ins = [where.get(x, Source("const", None)) for x in node.input if x]
        if (node.domain, node.op_type) in functions:
            k = len(calls)
            attrs = tuple(sorted(a.SerializeToString() for a in node.attribute))
            calls.append((node.op_type, ins, (node.domain, attrs)))
            where.update({o: Source("call", (k, r)) for r, o in enumerate(node.output)})
            continue
        if node.op_type == "Cast" and len(ins) == 1 and ins[0].kind == "weight":
            to = next(a.i for a in node.attribute if a.name == "to")
            where[node.output[0]] = Source("weight", (ins[0].key, to))
            continue
        # a Shape reads no values: ref's trace knows dims from the specialization
        reached = frozenset() if node.op_type in SHAPE_OPS else _union(reach(s) for s in ins)
        for o in node.output:
            where[o] = Source("glue", o) if reached else Source("const", None)
            if reached:
                frontier[o] = reached
    outputs = [where.get(o.name, Source("const", None)) for o in graph.output]
    return Calls(calls, outputs, frontier), held


def _weight(graph_key):
    """(initializer name, the ONNX type it is cast to or None) of a graph weight Source key."""
    return graph_key if isinstance(graph_key, tuple) else (graph_key, None)


class _Matcher:
    """Compares Sources of `ref` and the graph, holding the glue bijection."""

    def __init__(self, ref, graph, held, tensors):
        self.ref, self.graph, self.held, self.tensors = ref, graph, held, tensors
        self.to_graph, self.to_ref = {}, {}

    def fault(self, want, got):
        """Why the graph's Source `got` is not `ref`'s `want`, or None."""
        if want.kind == "weight" and got.kind == "weight":
            return self._weight_fault(want.key, _weight(got.key)[0])
        if want.kind == "const" and got.kind == "const":
            return None
        if want.kind == "glue" and got.kind == "glue":
            return self._glue_fault(want, got)
        if want != got:
            return f"ref binds {_say(want)}, the graph {_say(got)}"
        return None

    def _weight_fault(self, name, init):
        held = self.held.get(init)
        if init != name:
            return f"ref binds weight {name!r}, the graph initializer {init!r}"
        if held != name:
            info = self.tensors.get(name)
            where = "no checkpoint tensor" if held is None else f"the bytes of {held!r}"
            span = "" if info is None else f" (expected {info.file.name} at {info.offset}, "
            span += "" if info is None else f"{info.nbytes} bytes, {info.dtype} {info.shape})"
            return f"initializer {init!r} is external data at {where}{span}"
        return None

    def _glue_fault(self, want, got):
        theirs = self.to_graph.setdefault(want.key, got.key)
        ours = self.to_ref.setdefault(got.key, want.key)
        if theirs != got.key or ours != want.key:
            return f"glue value {got.key!r} stands where ref passes another value"
        a = self.ref.frontier[want.key]
        b = self.graph.frontier[got.key]
        if a != b:
            extra = sorted(_say(s) for s in b - a)[:2]
            missing = sorted(_say(s) for s in a - b)[:2]
            return (f"glue value {got.key!r} is computed from {extra or 'nothing more'} and "
                    f"not from {missing or 'nothing less'} where ref's is")  # fmt: skip
        return None


def _say(s):
    if s.kind == "call":
        return f"call {s.key[0]} result {s.key[1]}"
    if s.kind == "glue":
        return f"glue value {s.key!r}" if isinstance(s.key, str) else "a glue value"
    return f"{s.kind} {s.key!r}"


def _same_function(calls):
    """Faults where calls of one function differ in domain, arity, attributes or how each
    weight is widened."""
    first, out = {}, []
    for k, (fn, ins, attrs) in enumerate(calls):
        shape = (attrs, len(ins), tuple(_weight(s.key)[1] for s in ins if s.kind == "weight"))
        j, seen = first.setdefault(fn, (k, shape))
        if seen != shape:
            out.append(f"call {k} ({fn}) differs from call {j} of its function in its domain, "
                       f"attributes, arity or weight casts")  # fmt: skip
    return out


def faults(spec, model, folder, checkpoint):
    """Every way the graph `model` (in `folder`) binds a layer call or an output otherwise
    than `ref`'s composition of `spec` (built with layer functions) does, one line each naming
    the call; [] is the proof. checkpoint: its headers (`tensors`) only."""
    tensors = checkpoint.tensors
    ref = ref_calls(spec, {n: i.shape for n, i in tensors.items()})
    graph, held = graph_calls(model, folder, checkpoint)
    if [c[0] for c in ref.calls] != [c[0] for c in graph.calls]:
        return [f"the graph calls {[c[0] for c in graph.calls]}; ref calls "
                f"{[c[0] for c in ref.calls]}"]  # fmt: skip
    match, out = _Matcher(ref, graph, held, tensors), _same_function(graph.calls)
    for k, ((fn, want, _), (_, got, _)) in enumerate(zip(ref.calls, graph.calls, strict=True)):
        if len(want) != len(got):
            out.append(f"call {k} ({fn}): {len(got)} inputs, ref passes {len(want)}")
            continue
        for j, (w, g) in enumerate(zip(want, got, strict=True)):
            why = match.fault(w, g)
            if why:
                out.append(f"call {k} ({fn}) input {j}: {why}")
    for t, w, g in zip(spec.outputs, ref.outputs, graph.outputs, strict=True):
        why = match.fault(w, g)
        if why:
            out.append(f"output {t.name}: {why}")
    return out


def layer_calls(model):
    """The function names of the graph's top-level layer calls, in order."""
    functions = {(f.domain, f.name) for f in model.functions}
    return [n.op_type for n in model.graph.node if (n.domain, n.op_type) in functions]


def summary(model):
    """(calls, distinct functions) of the graph's top-level layer calls."""
    called = layer_calls(model)
    return len(called), len(set(called))
