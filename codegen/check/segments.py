"""The exported graph cut at its layer calls, run in onnxruntime a segment at a time (for
`verify` and `verify --precision` layer by layer: `codegen.check.layerwise`,
`codegen.check.layered_precision`).

`segments` cuts the top-level nodes into each layer call alone (with the Casts of its own
weights) and the runs of glue between calls; `Runner` runs them in order, each as its own
onnxruntime model, dropping values no later segment reads; a layer call's weights read from
the very bytes `ref` read are fed `ref`'s arrays (`supplied_weights.bound_weights`); a glue
segment that projects onto the output head runs a slice of the head's rows at a time
(`vocab_slices`), after being cut at the projection when it also reads the projection whole
(`head_cut`: the speculate graph's acceptance and drafts); a call `verify` by layer function
does not check is skipped, given stand-ins (`Runner.skip`).
"""

import dataclasses
import os

import numpy as np
import onnx
from onnx import helper

from codegen import graphs
from codegen.check.device_graph import Inexact
from codegen.check.head_slices import head_cut, head_rows, rows_before_cast, vocab_slices
from codegen.check.supplied_weights import Supplier, bound_weights
from codegen.folder.sessions import give_back, session_at


class LayerwiseError(ValueError):
    """The graph cannot be checked layer by layer (no layer functions in it)."""


def has_layers(model):
    """True when the top-level graph calls the model's own functions (layers)."""
    functions = {(f.domain, f.name) for f in model.functions}
    return any((n.domain, n.op_type) in functions for n in model.graph.node)


@dataclasses.dataclass
class Segment:
    """Top-level nodes run as one onnxruntime model: a layer call (`layer` its index among the
    calls) or glue (`layer` None); `needs` the values it reads from earlier segments or the
    graph inputs, `makes` the values later segments or the graph's outputs read."""

    nodes: list
    layer: int | None
    needs: list = dataclasses.field(default_factory=list)
    makes: list = dataclasses.field(default_factory=list)
    weights: list = dataclasses.field(default_factory=list)


def _constant_values(graph):
    """Names whose value is fixed by the graph alone: initializers and the outputs of nodes
    that read nothing else (weight Casts, Constants)."""
    fixed = {t.name for t in graph.initializer}
    producer = {}
    for node in graph.node:
        if all(x in fixed or x == "" for x in node.input):
            fixed.update(node.output)
            for o in node.output:
                producer[o] = node
    return fixed, producer


def segments(model):
    """The graph's top-level nodes cut into `Segment`s, in execution order (see the module)."""
    graph = model.graph
    functions = {(f.domain, f.name) for f in model.functions}
    fixed, const_producer = _constant_values(graph)
    initializers = {t.name for t in graph.initializer}
    const_nodes = {id(n) for n in const_producer.values()}
    order = {id(n): i for i, n in enumerate(graph.node)}
    out, layer = [], 0
    for node in graph.node:
        if id(node) in const_nodes:
            continue
        if (node.domain, node.op_type) in functions:
            out.append(Segment([node], layer))
            layer += 1
        elif out and out[-1].layer is None:
            out[-1].nodes.append(node)
        else:
            out.append(Segment([node], None))
    last_use = {}
    for i, seg in enumerate(out):
        made = set()
        pulled, weights = {}, []
        for node in seg.nodes:
            stack = [x for x in node.input if x in fixed and x not in initializers]
            while stack:
                c = const_producer[stack.pop()]
                if id(c) not in pulled:
                    pulled[id(c)] = c
                    stack += [x for x in c.input if x in fixed and x not in initializers]
        seg.nodes = sorted(pulled.values(), key=lambda n: order[id(n)]) + seg.nodes
        for node in seg.nodes:
            for x in node.input:
                if x in initializers:
                    weights.append(x)
                elif x and x not in made and x not in seg.needs:
                    seg.needs.append(x)
                    last_use[x] = i
            made.update(node.output)
        seg.weights = list(dict.fromkeys(weights))
    outputs = {o.name for o in graph.output}
    for i, seg in enumerate(out):
        for node in seg.nodes:
            wanted = seg.layer is not None and node is seg.nodes[-1]  # a call: all compared
            seg.makes += [
                o for o in node.output if wanted or last_use.get(o, -1) > i or o in outputs
            ]
    return out, last_use


def _part(nodes, inits):
    """A glue `Segment` of `nodes` (makes left to the caller): what it reads from outside, its
    weights."""
    seg, made = Segment(list(nodes), None), set()
    for node in nodes:
        for x in node.input:
            if x in inits:
                seg.weights.append(x)
            elif x and x not in made and x not in seg.needs:
                seg.needs.append(x)
        made.update(node.output)
    seg.weights = list(dict.fromkeys(seg.weights))
    return seg


_ONNX_TYPES = {
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.float64): onnx.TensorProto.DOUBLE,
    np.dtype(np.int32): onnx.TensorProto.INT32,
    np.dtype(np.int64): onnx.TensorProto.INT64,
    np.dtype(np.bool_): onnx.TensorProto.BOOL,
}


class Runner:
    """onnxruntime over one graph's segments at one specialization (see the module)."""

    def __init__(self, model, folder, feed, head=None, checkpoint=None, rewrite=None, probe=None,
                 shared=False, full=None):  # fmt: skip
        """rewrite(segment ModelProto, full) → (ModelProto, probed names, extra outputs): each
        segment run as rewritten, its extra outputs handed to probe(segment ModelProto, probed
        names, {extra output: value}, the segment's feed) (`verify --precision`). full: the
        tensor names to give full statistics (`device_graph`), the others fast ones: those
        the probe could not judge from fast ones (`_Probed`), in this segment or an earlier
        one (a layer's mask fill is -inf in every layer call). shared: the layer calls'
        tensors from the process's `sessions.shared_arena` (for a process that ends after the
        run; glue's are one-offs, the output head's slices 2 GB of them, and not kept). full:
        a set of names given full statistics from the start, which this run adds to (shared
        by the runs of one graph at its specializations: the same names need them, and found
        anew each layer function's first call ran twice)."""
        self.model, self.folder, self.shared = model, folder, shared
        # the output head, or heads: a speculate graph's drafter projects onto its own too
        self.heads = tuple(h for h in (head if isinstance(head, tuple) else (head,)) if h)
        self.checkpoint = checkpoint
        self.rewrite, self.probe = rewrite, probe
        self.segments, self.last_use = segments(model)
        self.inits = {t.name: t for t in model.graph.initializer}
        self.values = dict(feed)
        self.outputs = {o.name for o in model.graph.output}
        self.made = {}  # graph outputs onnxruntime made, compared at the end
        self.full = set() if full is None else full  # names given full statistics (`rewrite`)
        self.next = 0
        self.calls = [i for i, s in enumerate(self.segments) if s.layer is not None]
        self.supplier = None if checkpoint is None else Supplier(folder, checkpoint)

    def _session(self, nodes, needs, makes, weights, feed, supply=False):
        graph = helper.make_graph(
            rows_before_cast(nodes, set(weights)),
            f"segment_{self.next}",
            [
                helper.make_tensor_value_info(n, _ONNX_TYPES[np.asarray(feed[n]).dtype], None)
                for n in needs
            ],
            [onnx.ValueInfoProto(name=n) for n in makes],
            initializer=[self.inits[w] for w in weights],
        )
        m = helper.make_model(
            graph,
            opset_imports=list(self.model.opset_import),
            ir_version=self.model.ir_version,
            functions=list(self.model.functions),
        )
        path = os.path.join(self.folder, f".layerwise.{os.getpid()}.onnx")
        if self.rewrite is None:
            return _Probed(self._open(m, path, supply), m)
        data = m.SerializeToString()

        def rewritten(inexact=()):
            self.full.update(inexact)
            model, *probed = self.rewrite(onnx.ModelProto.FromString(data), frozenset(self.full))
            return self._open(model, path, supply), *probed

        session, names, extra = rewritten()
        return _Probed(session, m, names, extra, self.probe, again=rewritten)

    def _open(self, model, path, supply):
        """(session, the checkpoint weights it was given: `supplied_weights`, a layer call's
        only; glue reads its tables, the embedding's of 1–3 GB, by a few rows)."""
        given = {} if self.supplier is None or not supply else self.supplier.values(model)
        return session_at(model, path, given, self.shared and supply), given

    def _outputs(self, seg, feed):
        """The segment's `makes` as onnxruntime computes them (a `Drawn` input drawn for the
        run); a glue segment that projects onto the output head runs once per VOCAB_ROWS rows
        of it (`vocab_slices`)."""
        feed = {n: graphs.drawn(feed[n]) for n in seg.needs}
        if seg.layer is None and self.checkpoint is not None:
            for head in self.heads:
                sliced = vocab_slices(seg, head, self.inits)
                if sliced is not None:
                    return self._sliced(seg, feed, head, sliced)
                parts = self._cut(seg, head)
                if parts is not None:
                    return self._in_parts(seg, parts, feed)
        session = self._session(seg.nodes, seg.needs, seg.makes, seg.weights, feed,
                                seg.layer is not None)  # fmt: skip
        return session.run(seg.makes, {n: feed[n] for n in seg.needs})

    def _sliced(self, seg, feed, head, sliced):
        """`_outputs` of glue `seg` run once per VOCAB_ROWS rows of `head` (`vocab_slices`)."""
        nodes, fed, derived = sliced
        weights = [w for w in seg.weights if w != head]
        session = self._session(nodes, [*seg.needs, fed], seg.makes, weights,
                                {**feed, fed: np.zeros(1, np.float32)})  # fmt: skip
        parts = [
            session.run(seg.makes, {**{n: feed[n] for n in seg.needs}, fed: rows})
            for rows in head_rows(self.checkpoint, head)
        ]
        return [
            np.concatenate([p[k] for p in parts], axis=-1) if n in derived else parts[0][k]
            for k, n in enumerate(seg.makes)
        ]

    def _cut(self, seg, head):
        """Glue `seg` as two segments (`head_cut`), the first run a slice of `head` at a
        time (`vocab_slices`), or None."""
        cut = head_cut(seg.nodes, head, self.inits)
        if cut is None:
            return None
        first, rest = (_part(nodes, self.inits) for nodes in cut)
        own = {o for n in rest.nodes for o in n.output}  # the head's Cast: made there again
        later = (set(seg.makes) | {x for n in rest.nodes for x in n.input}) - own
        first.makes = [o for n in first.nodes for o in n.output if o in later]
        rest.makes = [o for n in rest.nodes for o in n.output if o in seg.makes]
        if not first.makes:  # nothing made from the head but its Cast (a Gather's table)
            return None
        return (first, rest) if vocab_slices(first, head, self.inits) else None

    def _in_parts(self, seg, parts, feed):
        """`_outputs` of glue `seg` run as its `_cut` parts, in order."""
        values = dict(feed)
        for part in parts:
            values.update(zip(part.makes, self._outputs(part, values), strict=True))
        return [values[n] for n in seg.makes]

    def _run(self, seg, feed):
        out = self._outputs(seg, feed)
        self._past(seg)
        for n, v in zip(seg.makes, out, strict=True):
            if n in self.outputs and seg.layer is None:
                self.made[n] = v
        return dict(zip(seg.makes, out, strict=True))

    def _past(self, seg):
        """Move past segment `seg` (the next), dropping the values it read last."""
        self.next += 1
        for n in seg.needs:
            if self.last_use.get(n) == self.next - 1 and n not in self.outputs:
                self.values.pop(n, None)

    def glue_until(self, call):
        """Run the glue before layer call `call` (all remaining glue when None)."""
        stop = len(self.segments) if call is None else self.calls[call]
        while self.next < stop:
            seg = self.segments[self.next]
            if seg.layer is not None:
                raise LayerwiseError(f"layer call {seg.layer} reached before `ref` gave it")
            self.values.update(self._run(seg, self.values))

    def run_all(self):
        """Every segment, layer calls included, on the values onnxruntime made itself → yields
        (graph output, value) as each is made; values no later segment reads are dropped."""
        while self.next < len(self.segments):
            at = self.next
            seg = self.segments[at]
            for n, v in self._run(seg, self.values).items():
                if n in self.outputs:
                    self.made.pop(n, None)
                    yield n, v
                if self.last_use.get(n, -1) > at:
                    self.values[n] = v
            if seg.layer is not None:
                give_back()

    def layer(self, call, kind, arrays, weights, made):
        """Layer call `call` (function `kind`) on `ref`'s inputs `arrays` and its weights
        [(checkpoint name, float32 array)] → (its inputs as onnxruntime's glue made them, or
        None where `ref`'s carry on, and its results on `ref`'s inputs); then `ref`'s results
        `made` carry on. A weight the graph reads from the very bytes `ref` read is fed
        `ref`'s array (`bound_weights`), so the layer's weights are held once."""
        self.glue_until(call)
        seg = self.segments[self.next]
        node = seg.nodes[-1]
        args = list(node.input)[: len(arrays)]
        if (node.op_type, len(node.input)) != (kind, len(arrays) + len(weights)):
            raise LayerwiseError(
                f"layer call {call} is {node.op_type} with {len(node.input)} inputs; `ref` "
                f"called {kind} with {len(arrays)} arrays and {len(weights)} weights"
            )
        glue = {n: self.values[n] for n in args if _made(self.values.get(n))}
        feed = dict(self.values)
        feed.update({n: np.asarray(a) for n, a in zip(args, arrays, strict=True)})
        if self.checkpoint is not None:
            seg, bound = bound_weights(seg, len(arrays), weights, self.inits, self.folder,
                                       self.checkpoint.tensors)  # fmt: skip
            feed.update(bound)
        got = self._run(seg, feed)
        ours = [got[o] for o in node.output]
        for n, v in zip(node.output, made, strict=True):
            if self.last_use.get(n, -1) >= self.next:  # read by a later segment
                self.values[n] = np.asarray(v)
        return [glue.get(n) for n in args], ours

    def skip(self, call, n_arrays, made):
        """Layer call `call` not run: its results are `made` (stand-ins `ref` is given too)
        → its first `n_arrays` inputs as onnxruntime's glue made them (None where not)."""
        self.glue_until(call)
        seg = self.segments[self.next]
        node = seg.nodes[-1]
        glue = [self.values.get(n) for n in node.input[:n_arrays]]
        self._past(seg)
        for n, v in zip(node.output, made, strict=True):
            if self.last_use.get(n, -1) >= self.next:
                self.values[n] = np.asarray(v)
        return [g if _made(g) else None for g in glue]

    def released(self, call, names, made):
        """`released` for layer call `call`, onnxruntime's `names` of its results `made`."""
        return released(made, names, self.outputs, self.last_use, self.calls[call])


def _made(x):
    """True for a value a segment made or was fed (not an input still to draw)."""
    return x is not None and not isinstance(x, graphs.Drawn)


def released(made, names, outputs, last_use, at):
    """`made` (a layer call's `ref` results; `names`: onnxruntime's for them, the call the
    segment at index `at`) with each graph output that no later segment reads, compared
    already, replaced by a `graphs.Released` of its shape and dtype: a step's new caches are
    then not all held until it ends."""
    return tuple(
        graphs.Released(v.shape, v.dtype) if n in outputs and last_use.get(n, -1) <= at else v
        for n, v in zip(names, made, strict=True)
    )


@dataclasses.dataclass
class _Probed:
    """A segment's session whose run also hands its extra outputs to `probe`. A probe that
    cannot answer from them (`device_graph.Inexact`: the fast statistics of tensors that are
    not all finite) makes it run again, and on, as `again(names)` gives it: (opened, probed
    names, extra outputs) of the segment rewritten with full statistics for them. opened:
    (session, the weights given to it, kept alive with it)."""

    opened: tuple
    model: object
    names: tuple = ()
    extra: tuple = ()
    probe: object = None
    again: object = None

    def run(self, names, feed):
        if not self.extra:
            return self.opened[0].run(names, feed)
        wanted = [*names, *self.extra]
        got = dict(zip(wanted, self.opened[0].run(wanted, feed), strict=True))
        try:
            self.probe(self.model, self.names, {n: got[n] for n in self.extra}, feed)
        except Inexact as e:  # from here on, with full statistics for those tensors
            self.opened, self.names, self.extra = self.again(e.names)
            return self.run(names, feed)
        return [got[n] for n in names]
