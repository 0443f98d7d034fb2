"""`verify` layer by layer: a released-size graph checked in memory set by its largest layer.

The exported graph calls one ONNX function per decoder layer. Its top-level nodes are cut into
segments: each layer call alone (with the Casts of its own weights), and the runs of glue
between calls (embeddings, vision merge, masks, rotary tables, final norm, logits). `ref` runs
the graph's composition eagerly with every layer's weights left out; when it reaches a layer,
`check` reads that layer's weights from the shards, runs the `ref` layer, and runs in
onnxruntime first the glue segments that come before the call, then the call alone on the
same inputs `ref` gave its layer (so an error stays in the layer that made it). onnxruntime's
values that `ref` also has are compared where both exist: glue results against the `ref`
layer's inputs, each call's results against the `ref` layer's results, the graph's other
outputs against `ref`'s at the end. Then the layer's weights and sessions are dropped, and
values no later segment reads are freed.

The dense attention of `ref` runs one slice of queries at a time (`sliced_reference`), so its
scores stay near `SCORE_BYTES` at any context length.
"""

import dataclasses
import os
import re
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import onnx
from onnx import helper

from codegen import graphs
from codegen.external import WeightError, onnx_dtype
from codegen.folder import LIBC, session_at
from ref.attention import reference
from ref.gemma4.step import Logits
from ref.layers import Embedding
from ref.numerics import aval, host_call
from weights import read_block

RTOL = 1e-5  # as verify.RTOL: the same tolerance per compared value
SCORE_BYTES = 1 << 28  # float32 scores of one query slice of the dense reference
ERROR_CHUNK = 1 << 24  # elements compared at a time (a 1 GiB cache: 64 chunks of 128 MiB)
VOCAB_ROWS = 1 << 15  # rows of the output head read at a time (262144 × 5376: 8 slices)
SPILL_BYTES = 64 << 20  # a `ref` result above this waits on disk while it is not read (`spilled`)
LAYER_NAME = re.compile(r"(^|\.)layers\.\d+\.")
_PLACEHOLDER = np.zeros((0,), np.float32)


class LayerwiseError(ValueError):
    """The graph cannot be checked layer by layer (no layer functions in it)."""


def sliced_reference(q, k, v, q_pos, kv_pos, *, q_group=None, kv_group=None, **kw):
    """`ref.attention.reference` computed over slices of the queries, concatenated (exact:
    each query attends independently). q: [B, H, S, D]; the slice keeps H·slice·T float32
    scores under SCORE_BYTES."""
    b, h, s, _ = q.shape
    step = max(1, SCORE_BYTES // (4 * b * h * k.shape[2]))
    if step >= s:
        return reference(q, k, v, q_pos, kv_pos, q_group=q_group, kv_group=kv_group, **kw)
    parts = []
    for a in range(0, s, step):
        z = slice(a, min(a + step, s))
        grp = (None, None) if q_group is None else (q_group[:, z], kv_group)
        parts.append(
            reference(q[:, :, z], k, v, q_pos[:, z], kv_pos, q_group=grp[0], kv_group=grp[1], **kw)
        )
    return jnp.concatenate(parts, axis=2)


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


def rows_before_cast(nodes, weights):
    """`nodes` with each Gather of a cast weight (`Gather(Cast(W), i)`) computed as
    `Cast(Gather(W, i))`: the same values (a cast acts per element), without converting the
    whole table to float32 first (E2B's per-layer embeddings: 9.4 GB). A Cast of a weight
    that nothing else reads is dropped. The export keeps its own order."""
    cast_of = {
        n.output[0]: n.input[0]
        for n in nodes
        if n.op_type == "Cast" and n.input[0] in weights and n.domain in ("", "ai.onnx")
    }
    out, kept = [], set()
    for n in nodes:
        if n.op_type == "Gather" and n.input[0] in cast_of:
            cast = next(c for c in nodes if c.output[0] == n.input[0])
            rows = n.output[0] + "::rows"
            gather = helper.make_node(
                "Gather", [cast_of[n.input[0]], *n.input[1:]], [rows], name=n.name
            )
            gather.attribute.extend(n.attribute)
            out += [gather, helper.make_node("Cast", [rows], list(n.output), name=rows)]
            out[-1].attribute.extend(cast.attribute)
            continue
        kept.update(n.input)
        out.append(n)
    return [n for n in out if n.output[0] not in cast_of or n.output[0] in kept]


# ops through which the output head's rows stay columns of the result, each its own
_PER_COLUMN = {"Cast", "Identity", "Transpose", "MatMul", "Mul", "Div", "Add", "Sub", "Tanh"}


def vocab_slices(seg, head, inits):
    """How to run glue segment `seg` a slice of `head`'s rows at a time, or None.

    Applies when `head` (a [V, D] initializer of more than VOCAB_ROWS rows) reaches the
    segment's outputs only through `_PER_COLUMN` ops that keep its rows as the outputs' last
    axis (Cast, a Transpose moving them last, the right operand of MatMul, elementwise ops):
    then each slice of rows gives those columns of the outputs. → (nodes with the head's
    float32 Cast, or the head itself, read as a graph input instead; that input's name; the
    outputs computed per slice)."""
    t = inits.get(head)
    if t is None or head not in seg.weights or len(t.dims) != 2 or t.dims[0] <= VOCAB_ROWS:
        return None
    axis = {head: -2}  # where the head's rows are in each value made from it, from the end
    fed, nodes = head, []
    for n in seg.nodes:
        reads = [x for x in n.input if x in axis]
        if not reads:
            nodes.append(n)
            continue
        if n.op_type not in _PER_COLUMN:
            return None
        a = axis[reads[0]]
        if n.op_type == "Transpose":
            perm = next(h.ints for h in n.attribute if h.name == "perm")
            a = list(perm).index(len(perm) + a) - len(perm)
        elif n.op_type == "MatMul" and (n.input[0] in axis or a != -1):
            return None
        if n.op_type == "Cast" and n.input[0] == head and len(n.output) == 1:
            fed = n.output[0]
            axis[fed] = a
            continue
        axis.update(dict.fromkeys(n.output, a))
        nodes.append(n)
    derived = [x for x in seg.makes if x in axis]
    if any(axis[x] != -1 for x in derived) or any(head in n.input for n in nodes):
        return None
    return nodes, fed, set(derived)


_ONNX_TYPES = {
    np.dtype(np.float32): onnx.TensorProto.FLOAT,
    np.dtype(np.float64): onnx.TensorProto.DOUBLE,
    np.dtype(np.int32): onnx.TensorProto.INT32,
    np.dtype(np.int64): onnx.TensorProto.INT64,
    np.dtype(np.bool_): onnx.TensorProto.BOOL,
}


class Runner:
    """onnxruntime over one graph's segments at one specialization (see the module)."""

    def __init__(self, model, folder, feed, head=None, checkpoint=None, rewrite=None, probe=None):
        """rewrite(segment ModelProto) → (ModelProto, probed names, extra outputs): each
        segment run as rewritten, its extra outputs handed to probe(segment ModelProto, probed
        names, {extra output: value}, the segment's feed) (`verify --precision`)."""
        self.model, self.folder = model, folder
        self.head, self.checkpoint = head, checkpoint
        self.rewrite, self.probe = rewrite, probe
        self.segments, self.last_use = segments(model)
        self.inits = {t.name: t for t in model.graph.initializer}
        self.values = dict(feed)
        self.outputs = {o.name for o in model.graph.output}
        self.made = {}  # graph outputs onnxruntime made, compared at the end
        self.next = 0
        self.calls = [i for i, s in enumerate(self.segments) if s.layer is not None]

    def _session(self, nodes, needs, makes, weights, feed):
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
            return _Probed(session_at(m, path), m)
        rewritten, *probed = self.rewrite(onnx.ModelProto.FromString(m.SerializeToString()))
        return _Probed(session_at(rewritten, path), m, *probed, self.probe)

    def _outputs(self, seg, feed):
        """The segment's `makes` as onnxruntime computes them (a `Drawn` input drawn for the
        run); a glue segment that projects onto the output head runs once per VOCAB_ROWS rows
        of it (`vocab_slices`)."""
        feed = {n: graphs.drawn(feed[n]) for n in seg.needs}
        sliced = None if seg.layer is not None else vocab_slices(seg, self.head, self.inits)
        if sliced is None or self.checkpoint is None:
            session = self._session(seg.nodes, seg.needs, seg.makes, seg.weights, feed)
            return session.run(seg.makes, {n: feed[n] for n in seg.needs})
        nodes, fed, derived = sliced
        weights = [w for w in seg.weights if w != self.head]
        session = self._session(nodes, [*seg.needs, fed], seg.makes, weights,
                                {**feed, fed: np.zeros(1, np.float32)})  # fmt: skip
        parts = [
            session.run(seg.makes, {**{n: feed[n] for n in seg.needs}, fed: rows})
            for rows in head_rows(self.checkpoint, self.head)
        ]
        return [
            np.concatenate([p[k] for p in parts], axis=-1) if n in derived else parts[0][k]
            for k, n in enumerate(seg.makes)
        ]

    def _run(self, seg, feed):
        out = self._outputs(seg, feed)
        index = self.next
        self.next += 1
        for n, v in zip(seg.makes, out, strict=True):
            if n in self.outputs and seg.layer is None:
                self.made[n] = v
        for n in seg.needs:
            if self.last_use.get(n) == index and n not in self.outputs:
                self.values.pop(n, None)
        return dict(zip(seg.makes, out, strict=True))

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


def _same_bytes(tensor, info, folder):
    """True when initializer `tensor` is external data at exactly checkpoint tensor `info`'s
    bytes (same file, offset, length, element type and shape)."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return False
    where = {e.key: e.value for e in tensor.external_data}
    try:
        place = os.path.realpath(os.path.join(folder, where["location"]))
        span = (int(where.get("offset", 0)), int(where["length"]))
        kind = onnx_dtype(info)
    except (KeyError, ValueError, WeightError):
        return False
    return (
        place == os.path.realpath(info.file)
        and span == (info.offset, info.nbytes)
        and (tensor.data_type, tuple(tensor.dims)) == (kind, tuple(info.shape))
    )


def bound_weights(seg, n_arrays, weights, inits, folder, tensors):
    """(the layer call segment `seg` with each weight input the graph reads from the bytes of
    the checkpoint tensor `ref` read for it — the initializer itself if float32, or its Cast
    to float32 — made a segment input; {that input: `ref`'s float32 array}). The values are
    the same (a widening cast is exact); a weight bound to any other bytes keeps the graph's
    own initializer, so onnxruntime computes with what the graph holds."""
    node = seg.nodes[-1]
    made_by = {o: n for n in seg.nodes[:-1] for o in n.output}
    dropped, bound = set(), {}
    for x, (name, array) in zip(node.input[n_arrays:], weights, strict=True):
        source, cast = x, made_by.get(x)
        if cast is not None:
            to = next((a.i for a in cast.attribute if a.name == "to"), None)
            if cast.op_type != "Cast" or to != onnx.TensorProto.FLOAT or len(cast.input) != 1:
                continue
            source = cast.input[0]
        elif inits.get(x) is None or inits[x].data_type != onnx.TensorProto.FLOAT:
            continue
        info = tensors.get(name)
        if source in inits and info is not None and _same_bytes(inits[source], info, folder):
            bound[x] = np.asarray(array)
            dropped.add(id(cast))
    if not bound:
        return seg, {}
    nodes = [n for n in seg.nodes if id(n) not in dropped]
    read = {i for n in nodes for i in n.input}
    seg = dataclasses.replace(
        seg, nodes=nodes, needs=[*seg.needs, *bound], weights=[w for w in seg.weights if w in read]
    )
    return seg, bound


@dataclasses.dataclass
class _Probed:
    """A segment's session whose run also hands its extra outputs to `probe`."""

    session: object
    model: object
    names: tuple = ()
    extra: tuple = ()
    probe: object = None

    def run(self, names, feed):
        if not self.extra:
            return self.session.run(names, feed)
        wanted = [*names, *self.extra]
        got = dict(zip(wanted, self.session.run(wanted, feed), strict=True))
        self.probe(self.model, self.names, {n: got[n] for n in self.extra}, feed)
        return [got[n] for n in names]


def error(got, want, chunk=ERROR_CHUNK):
    """(max abs error, relative error) of onnxruntime's `got` against `ref`'s `want`, in
    float64 over `chunk` elements at a time (a NaN anywhere gives NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf"), float("inf")
    if not want.size:
        return 0.0, 0.0
    got, want = got.reshape(-1), want.reshape(-1)
    err = scale = np.float64(0.0)
    for a in range(0, want.size, chunk):
        w = want[a : a + chunk].astype(np.float64)
        err = np.maximum(err, np.max(np.abs(got[a : a + chunk].astype(np.float64) - w)))
        scale = np.maximum(scale, np.max(np.abs(w)))
    err, scale = float(err), float(scale)
    return err, err / scale if scale else err


class Worst:
    """The largest relative error per compared output, and where it was."""

    def __init__(self):
        self.rows = {}

    def add(self, output, got, want, where, exact=False):
        err, rel = error(got, want)
        ok = err == 0 if exact else rel <= RTOL
        old = self.rows.get(output)
        if old is None or (not ok and old[3]) or (ok == old[3] and rel > old[1]):
            self.rows[output] = (err, rel, where, ok)


def _checkpoint_name(names, module, keys):
    """The checkpoint name of parameter `keys` of the bound `module`: the one name of the
    graph's weights ending in the module's path and the keys."""
    suffix = ".".join([*module.path, *keys])
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    if len(found) != 1:
        raise LayerwiseError(f"parameter {suffix!r}: {len(found)} checkpoint names end in it")
    return found[0]


def _layer_names(names, module):
    """The checkpoint names of the bound layer's parameters, in leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(module.variables["params"])
    return [_checkpoint_name(names, module, [k.key for k in path]) for path, _ in flat]


def _layer_arrays(names, checkpoint, module):
    """The bound layer's parameters read from the shards as float32 numpy arrays, in leaf
    order, each `aligned` (so `jax.device_put` shares it: one copy serves `ref` and
    onnxruntime; `np.asarray` of a jax array would copy)."""
    return [
        aligned(checkpoint.read(n, mapped=False), dtype=np.float32)
        for n in _layer_names(names, module)
    ]


def _layer_weights(names, checkpoint, module):
    """The bound layer's parameters read from the shards as float32 jax arrays."""
    return [jax.device_put(a) for a in _layer_arrays(names, checkpoint, module)]


def _gather_rows(names, checkpoint):
    """An interceptor computing `ref.layers.Embedding` from the shard's rows when its table
    was left out (`weight[ids] · scale`, only the rows asked for are read; traced ids: the
    read is a `host_call`)."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if not isinstance(module, Embedding) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if module.variables["params"]["weight"].size:
            return next_fun(*args, **kwargs)
        table = checkpoint.read(_checkpoint_name(names, module, ["weight"]))

        def rows(ids):
            return [jnp.asarray(np.asarray(table[np.asarray(ids)], np.float32))]

        ids = args[0]
        if isinstance(ids, jax.core.Tracer):
            (got,) = host_call(rows, [aval((*ids.shape, table.shape[1]))], ids)
        else:
            (got,) = rows(ids)
        return got * jnp.asarray(module.scale, jnp.float32)

    return interceptor


def head_rows(checkpoint, name):
    """Checkpoint tensor `name`'s rows, VOCAB_ROWS at a time, as float32 arrays, each read
    from the shard alone (`weights.blocks.read_block`): no page of the table stays mapped,
    where a mapped read of the 31B's 2.8 GB head kept every touched page in the process's
    resident memory until the end."""
    info = checkpoint.tensors[name]
    for a in range(0, info.shape[0], VOCAB_ROWS):
        yield np.asarray(read_block(info, (slice(a, a + VOCAB_ROWS),)), np.float32)


def _head_slices(name, checkpoint):
    """An interceptor computing `ref.gemma4.step.Logits` with its weight left out: the module
    itself on VOCAB_ROWS rows of the checkpoint's `name` at a time, joined along the vocab."""

    def interceptor(next_fun, args, kwargs, context):
        mine = isinstance(context.module, Logits) and context.method_name == "__call__"
        if not mine or args[1].size:
            return next_fun(*args, **kwargs)
        parts = [next_fun(args[0], jnp.asarray(rows)) for rows in head_rows(checkpoint, name)]
        return jnp.concatenate(parts, axis=-1)

    return interceptor


def _weights(spec, checkpoint):
    """verify's {name: float32 weight}, with every layer's weights, the row-gathered tables
    and the output head left out (an empty placeholder): they are read when `ref` reaches
    them."""
    deferred = {n for n in spec.weights if LAYER_NAME.search(n)} | set(spec.gathered)
    deferred |= {spec.head} - {None}
    return {
        n: _PLACEHOLDER
        if n in deferred
        else np.asarray(checkpoint.read(n, mapped=False), np.float32)
        for n in spec.weights
    }


def _kernel(spec):
    """The language graphs' reference attends by query slices (`sliced_reference`); the
    vision reference attends per item in tiles already."""
    return {"attention": sliced_reference} if spec.kind in ("prefill", "decode") else {}


def aligned(x, align=64, dtype=None):
    """x (as `dtype`, default its own) in a buffer aligned to `align` bytes, which
    `jax.device_put` on CPU uses in place instead of copying (numpy's large arrays start 16
    bytes into a page; `jnp.asarray` always copies): the sample's caches, read by both sides,
    are then held once. A conversion writes straight into the aligned buffer."""
    x = np.asarray(x)
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    if x.dtype == dtype and x.flags.c_contiguous and x.ctypes.data % align == 0:
        return x
    out = graphs.aligned_empty(x.shape, dtype, align)
    out[...] = x
    return out


def spilled(x, folder):
    """x, or when over SPILL_BYTES a read-only numpy copy mapped from a file in `folder`
    that is unlinked at once (the mapping keeps its bytes): the page cache holds it, and may
    drop it, not the process, until it is read. For `ref`'s large results while onnxruntime
    runs the same layer (a 31B full layer's written caches: 1 GiB)."""
    if x.nbytes <= SPILL_BYTES:
        return x
    fd, path = tempfile.mkstemp(prefix=".spill.", suffix=".npy", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.asarray(x))
        return np.load(path, mmap_mode="r")
    finally:
        os.remove(path)


def give_back():
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere
    nothing): a layer's buffers below glibc's mmap threshold are otherwise kept by the
    process, and its resident size creeps up layer after layer."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


def layered_reference(spec, checkpoint, feed, hook):
    """`spec.reference` on `feed` ({name: aligned array}, shared with `ref`, not copied) with
    the deferred weights (`_weights`) and each layer call handed to
    hook(module, kind, slot, arrays) (`graphs.layer_check`); tables gathered by rows, the
    head by vocabulary slices, attention by query slices."""
    shared = {
        n: x if n in spec.lazy else jax.device_put(aligned(graphs.drawn(x)))
        for n, x in feed.items()
    }
    with (
        graphs.layer_scope(),
        graphs.layer_check(hook),
        nn.intercept_methods(_gather_rows(spec.weights, checkpoint)),
        nn.intercept_methods(_head_slices(spec.head, checkpoint)),
    ):
        return spec.reference(shared, _weights(spec, checkpoint), **_kernel(spec))


def verify_specialization(spec, model, folder, checkpoint, feed, log):
    """Rows (output, max abs err, rel err, where, ok) of the graph `model` (`spec`'s export)
    on the inputs `feed`, checked layer by layer; log(line) reports each layer."""
    for name in list(feed):
        x = feed.pop(name)
        feed[name] = x if isinstance(x, graphs.Drawn) else aligned(x)
    runner = Runner(model, folder, feed, spec.head, checkpoint)
    worst = Worst()
    names = spec.weights
    calls = []
    started = time.perf_counter()

    def check(module, kind, slot, arrays):
        k = len(calls)
        given = [graphs.drawn(a) for a in arrays]  # a `Drawn` cache: drawn for this layer
        arrays = [jax.device_put(g) if isinstance(a, graphs.Drawn) else a
                  for a, g in zip(arrays, given, strict=True)]  # fmt: skip
        host = _layer_arrays(names, checkpoint, module)
        params = [jax.device_put(a) for a in host]
        made, out_map, tree = slot.results([*arrays, *params])
        if any(src == "in" and j >= len(arrays) for src, j in out_map):
            raise LayerwiseError(f"layer {k} ({kind}) returns one of its weights")
        slot = dataclasses.replace(slot, out_map=out_map, out_tree=tree)
        where = f"layer {k} ({kind})"
        weights = list(zip(_layer_names(names, module), host, strict=True))
        del params, host
        made = [spilled(m, folder) for m in made]  # on disk while onnxruntime runs the layer
        glue, ours = runner.layer(k, kind, given, weights, made)
        del weights, given
        for j, (a, g) in enumerate(zip(arrays, glue, strict=True)):
            if g is not None:
                worst.add("layer inputs", g, a, f"{where} input {j}", exact=a.dtype.kind != "f")
        named = runner.segments[runner.calls[k]].nodes[-1].output
        for n, o, r in zip(named, ours, made, strict=True):
            output = n if n in runner.outputs else "layer outputs"
            worst.add(output, o, r, where)
        calls.append(k)
        del ours, glue
        give_back()
        log(f"  {spec.name}: {where} checked, {time.perf_counter() - started:.1f} s")
        return slot.outputs(list(arrays), runner.released(k, named, made))

    want = layered_reference(spec, checkpoint, feed, check)
    runner.glue_until(None)
    for t in spec.outputs:
        if t.name in runner.made and t.name not in worst.rows:
            exact = np.asarray(want[t.name]).dtype.kind != "f"
            worst.add(t.name, runner.made[t.name], want[t.name], "glue", exact=exact)
    order = [t.name for t in spec.outputs] + ["layer inputs", "layer outputs"]
    return [(o, *worst.rows[o]) for o in order if o in worst.rows]
