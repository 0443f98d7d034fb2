"""`verify --precision` layer by layer: the device model at released sizes, in memory set by
the largest layer (see `codegen.check.layerwise` for the cut into segments and
`codegen.check.precision` for the device model and the report).

Three passes over one specialization, each holding one layer's weights at a time (run in the
order 1, 3, 2: pass 2 may allocate from onnxruntime's shared arena, which keeps what it grew to):

1. float32 `ref` (verify's layer-by-layer reference): the graph's outputs to compare with.
2. The exported graph in the device's format, one segment at a time (`device_graph.device_graph`
   of each glue run and each layer call, functions inlined, a rounding Cast pair after every
   float tensor), on the values its own earlier segments made: each tensor's largest |x|, the
   first tensor that turns non-finite (by ONNX name), each graph output's error to float32.
3. `ref` in the device model (`ref.numerics.probe`) over the exported composition, with each
   layer, each row-gathered table and the output head an opaque host call that reads its
   weights from the shards and runs the same device model inside it: records named by module
   path, as the whole-graph check names them.
"""

import dataclasses
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from codegen import graphs
from codegen.check import layerwise as lw
from codegen.check import mxfp6_weights
from codegen.check import segments as sg
from codegen.check.device_graph import (
    device_graph,
    first_nonfinite_name,
    first_nonfinite_onnx,
    layer_peaks,
    stats_of,
)
from codegen.check.head_slices import device_head
from codegen.check.layer_buffers import Buffers, Compiled, collected, stored_weights
from codegen.check.layer_replay import Replay
from codegen.check.plan_file import instances, plan_names, producers_of
from codegen.folder.sessions import give_back
from ref import numerics, validate
from ref.numerics import aval, host_call
from ref.probe_jit import probe_jit


@dataclasses.dataclass
class _Graph:
    """What the passes share about one graph: its segments, the ONNX names of each layer
    call's results and which values later segments read."""

    spec: object
    model: object
    checkpoint: object
    segments: list
    last_use: dict
    outputs: set

    @property
    def calls(self):
        return [s for s in self.segments if s.layer is not None]

    def call_names(self, k):
        return list(self.calls[k].nodes[-1].output)

    def released(self, k, made):
        """`segments.released` for layer call k."""
        at = self.segments.index(self.calls[k])
        return sg.released(made, self.call_names(k), self.outputs, self.last_use, at)


def _graph(spec, model, checkpoint):
    segs, last_use = sg.segments(model)
    return _Graph(spec, model, checkpoint, segs, last_use, {o.name for o in model.graph.output})


def ref_first(spec, model, checkpoint, precision, mxfp6, log):
    """first(feed, keep) for `npi.RefPlan`: pass 3 (`ref`'s device model, layer by layer) on
    feed with the `Record.key`s keep in float32 → the first Record that turns non-finite, or
    None."""
    g, replay = _graph(spec, model, checkpoint), Replay()

    def first(feed, keep):
        records = []
        try:
            _ref_device(g, feed, precision, None, None, log, mxfp6, keep, records, replay)
        except _Overflow:  # at the first layer boundary after it: the rest cannot come first
            pass
        return numerics.first_nonfinite(records)

    return first


def _exact(g, feed, spill):
    """Pass 1: {graph output: float32 `ref` value}, layer by layer (large ones
    `layerwise.spilled` to the folder `spill`)."""
    spec, names, checkpoint = g.spec, g.spec.weights, g.checkpoint
    got, calls, buffers, compiled = {}, [], Buffers(), Compiled()

    def hook(module, kind, slot, arrays):
        k = len(calls)
        calls.append(k)
        arrays = [jax.device_put(graphs.drawn(a)) for a in arrays]
        params = lw.layer_weights(names, checkpoint, module, buffers)
        made, out_map, tree = compiled.results(kind, slot, [*arrays, *params])
        del params
        slot = dataclasses.replace(slot, out_map=out_map, out_tree=tree)
        for n, v in zip(g.call_names(k), made, strict=True):
            if n in g.outputs:
                got[n] = lw.spilled(v, spill, HELD_BYTES)
        made = g.released(k, made)
        give_back()
        return slot.outputs(arrays, made)

    want = lw.layered_reference(spec, checkpoint, feed, hook)
    return {t.name: got[t.name] if t.name in got else lw.spilled(want[t.name], spill, HELD_BYTES)
            for t in spec.outputs}  # fmt: skip


# pass 1's graph outputs above this wait on disk until compared (`layerwise.spilled`): the 120
# caches of a 31B step, 16 MB each at ctx 1,024, are 2 GB held through passes 3 and 2
HELD_BYTES = 1 << 20


class _OnnxProbe:
    """Pass 2's sink: the largest finite |x| of the tensors rounded (those a plan's names
    `keep` are not) and the first non-finite tensor over segments."""

    def __init__(self, log, keep):
        self.peak, self.bad, self.log, self.runs = 0.0, None, log, 0
        self.keep = keep

    def __call__(self, model, names, got, feed):
        stats = stats_of(got, names)
        self.runs += 1
        if model.functions:
            self.log(f"onnx run {self.runs} (a layer call) done")
        kept = instances(model, self.keep) if self.keep else ()
        self.peak = max([self.peak, *(st[0] for n, st in stats.items() if n not in kept)])
        if self.bad is not None:
            return
        producers = producers_of(model)
        self.bad = first_nonfinite_onnx(_known(stats, feed), names, producers)


def _known(stats, feed):
    """`stats` with the segment's float inputs added as (0, no NaN, all finite?): only an
    input's finiteness is read, no copy or mask of a cache."""
    inputs = {n: (0.0, False, validate.all_finite(x))
              for n, x in feed.items() if np.asarray(x).dtype.kind == "f"}  # fmt: skip
    return {**inputs, **stats}


def _onnx_device(g, folder, feed, precision, exact, store, log, mxfp6, keep=(), shared=False):
    """Pass 2: (peak |x|, first non-finite name or None, {output: relative error}); each
    segment's matmul weights as MXFP6 with element `mxfp6` holds them, when given; the node
    outputs `keep` names (a node-precision plan's names) left in float32; shared: its
    sessions' tensors from `sessions.shared_arena`."""
    probe = _OnnxProbe(lambda line: log(f"  {g.spec.name}: {line}"), keep)
    rewrite = _device_rewrite(g.checkpoint, precision, mxfp6, keep)
    runner = sg.Runner(g.model, folder, feed, g.spec.head, g.checkpoint, rewrite=rewrite,
                       probe=probe, shared=shared)  # fmt: skip
    errors = {}
    for name, value in runner.run_all():
        errors[name] = lw.error(store(name, value), exact[name])[1]
    return probe.peak, probe.bad, errors


class _Overflow(Exception):
    """Raised by `_FirstOverflow` to stop a run at the first non-finite tensor."""


def _device_rewrite(checkpoint, precision, mxfp6, keep):
    """The `segments.Runner` rewrite of pass 2: each segment as the device computes it, its
    matmul weights as MXFP6 when `mxfp6` is given, the nodes the plan's names `keep` (a list,
    read at each call: a search appends to it) keep left in float32 (`instances`: a body
    name in the segment's call, whichever layer it is)."""

    def rewrite(m, full):
        mine = instances(m, keep)
        m = mxfp6_weights.initializers(m, checkpoint, mxfp6)
        return device_graph(m, precision, keep=mine, stats="fast", full=full)

    return rewrite


class _FirstOverflow:
    """A pass-2 sink for a node-precision plan: the largest finite |x| of the tensors the plan
    leaves rounded, and the first tensor that turns non-finite ((name, op)), which stops the
    run (`_Overflow`); named as the plan names them (`plan_names`: a body name for a node
    inside a layer call)."""

    def __init__(self, keep):
        self.keep, self.top, self.bad = keep, (0.0, None), None

    def __call__(self, model, names, got, feed):
        stats = stats_of(got, names)
        producers = producers_of(model)
        name = first_nonfinite_name(_known(stats, feed), names, producers)
        named = plan_names(model)
        if name is not None:
            if named[name] in self.keep:
                raise ValueError(f"{name!r} is non-finite with {named[name]!r} kept")
            self.bad = (named[name], producers[name].op_type)
            raise _Overflow(name)
        kept = instances(model, self.keep)
        rounded = [(st[0], named.get(n, n)) for n, st in stats.items() if n not in kept]
        self.top = max([self.top, *rounded], key=lambda t: t[0])  # ties: the first (0.0 at start)


def plan_search(spec, model, folder, checkpoint, feed, precision, keep, on_keep, mxfp6=None,
                full=None, shared=False):  # fmt: skip
    """The exported graph `model` in the device's format segment by segment (pass 2) on
    `feed`, the node outputs in `keep` (a list, whole-graph names) left in float32; each tensor
    that turns non-finite is appended to `keep`, on_keep(name, op) is told (it may raise to
    stop), and the run goes on from the segment that made it, run again with it kept: the
    segments before it are not run again (keeping a later node changes none of their values;
    a body name kept also keeps its node in earlier calls, which ran without it: the whole
    plan is proven again by `verify --precision`); full: `segments.Runner`'s (a set shared
    by the graph's specializations, or None); shared: the layer calls' tensors from
    `sessions.shared_arena` (a process that ends after the search)
    → (largest finite |x| left rounded, its name)."""
    sink = _FirstOverflow(keep)
    rewrite = _device_rewrite(checkpoint, precision, mxfp6, keep)
    runner = sg.Runner(model, folder, feed, spec.head, checkpoint, rewrite=rewrite, probe=sink,
                       full=full, shared=shared)  # fmt: skip
    try:
        while True:
            try:
                for _ in runner.run_all():
                    pass
                return sink.top
            except _Overflow:  # raised before the runner moved past the segment
                name, op = sink.bad
                sink.bad = None
                keep.append(name)
                on_keep(name, op)
    finally:
        give_back()


def _param_avals(names, checkpoint, module):
    return [
        jax.ShapeDtypeStruct(tuple(checkpoint.tensors[n].shape), jnp.float32)
        for n in lw.layer_names(names, module)
    ]


def _ref_device(g, feed, precision, exact, store, log, mxfp6, keep=(), stop=None, replay=None):
    """Pass 3: ({output: relative error} (none when `exact` is None), records); the matmul
    weights as MXFP6 with element `mxfp6` holds them, when given; the tensors `keep` names
    (`ref.numerics.Record.key`s) left in float32. stop: a list the records go to, and the run
    stops (`_Overflow`) at the first layer call reached once one of them turned non-finite
    (a plan's pairing reads only the first, its plan growing: a layer's program takes the
    plan as data once the plan keeps one of its tensors, `probe_jit`); replay: a
    `layer_replay.Replay` of the last run's layer calls, those that match not run again."""
    spec, names, checkpoint = g.spec, g.spec.weights, g.checkpoint
    records = [] if stop is None else stop
    errors, calls, buffers = {}, [], Buffers()

    def stopping():
        if stop is not None and numerics.first_nonfinite(records) is not None:
            raise _Overflow("ref")

    def hook(module, kind, slot, arrays):
        k = len(calls)
        calls.append(k)
        arrays = [_drawn_here(a) for a in arrays]
        params = _param_avals(names, checkpoint, module)
        found = {}

        def results(*a):
            distinct, found["map"], found["tree"] = slot.results(list(a))
            return distinct

        avals = [aval(x.shape, x.dtype) for x in jax.eval_shape(results, *arrays, *params)]
        slot = dataclasses.replace(slot, out_map=found["map"], out_tree=found["tree"])
        path = ".".join(module.path)

        def run(*concrete):
            stopping()
            key = None if replay is None else replay.key(path, concrete, keep)
            again = None if replay is None else replay.get(k, key)
            if again is not None:
                records.extend(again[0])
                stopping()
                return again[1]
            start = len(records)
            weights, stored = _layer_weights(names, checkpoint, module, buffers, precision, mxfp6)
            made, _ = probe_jit(
                lambda *a: slot.results(list(a))[0], precision, *concrete, *weights,
                records=records, prefix=path, keep=keep,
                stored=range(len(concrete), len(concrete) + stored),
            )  # fmt: skip
            del weights
            for n, v in zip(g.call_names(k), made, strict=True):
                if n in g.outputs and exact is not None:
                    errors[n] = lw.error(store(n, v), exact[n])[1]
            log(f"  {spec.name}: layer {k} ({kind}) in {precision}")
            made = g.released(k, made)
            if replay is not None:
                replay.put(k, key, records[start:], made)
            give_back()
            stopping()
            return made

        made = host_call(run, avals, *arrays)
        return slot.outputs(list(arrays), made)

    args = [feed[t.name] if t.name in spec.lazy else graphs.drawn(feed[t.name])
            for t in spec.inputs]  # fmt: skip
    deferred = lw.deferred_weights(spec, checkpoint)
    args += mxfp6_weights.weights(list(deferred), deferred.values(), mxfp6)
    lazy = {j: a for j, a in enumerate(args) if isinstance(a, graphs.Drawn)}

    def fn(*given):  # the `Drawn` inputs reach their layers as they are, not traced
        it = iter(given)
        return spec.fn(*(lazy[j] if j in lazy else next(it) for j in range(len(args))))

    with (
        graphs.layer_scope(),
        graphs.layer_check(hook),
        nn.intercept_methods(lw.gather_rows(names, checkpoint)),
        nn.intercept_methods(device_head(spec.head, checkpoint, precision, records, keep)),
    ):
        given = [a for j, a in enumerate(args) if j not in lazy]
        out, _ = numerics.probe(fn, precision, *given, records=records, keep=keep)
    for t, v in zip(spec.outputs, out, strict=True):
        if t.name not in errors and exact is not None:
            errors[t.name] = lw.error(store(t.name, v), exact[t.name])[1]
    return errors, records


def _layer_weights(names, checkpoint, module, buffers, precision, mxfp6):
    """(pass 3's weights of the bound layer `module`, how many of them are already rounded to
    `precision`): all (`layer_buffers.stored_weights`), or none when they are MXFP6's."""
    mine = lw.layer_names(names, module)
    if mxfp6 is None:
        return stored_weights(mine, checkpoint, buffers, precision), len(mine)
    weights = lw.layer_weights(names, checkpoint, module, buffers)
    return mxfp6_weights.weights(mine, weights, mxfp6), 0


def _drawn_here(x):
    """A `graphs.Drawn` layer argument as a host call that draws it, evaluated just before
    the layer that reads it; any other argument as it is."""
    if not isinstance(x, graphs.Drawn):
        return x
    return host_call(lambda: [x.value()], [aval(x.shape, x.dtype)])[0]


def precision_specialization(spec, model, folder, checkpoint, feed, precision, kv, log,
                             mxfp6=None, plan=((), ()), shared=False):  # fmt: skip
    """One specialization of `verify --precision` layer by layer → (layers [(layer, max
    |x|)], onnx max |x|, ref's first non-finite Record or None, onnx's first non-finite name
    or None, errors [(output, ref err, onnx err)]). feed: its inputs (retained ones already
    stored as `kv`); kv: the KV storage format or None; mxfp6: an MXFP6 element format for
    the device side's matmul weights (`codegen.check.mxfp6_weights`) or None; plan: (node
    outputs, `ref` keys) kept in float32 (`codegen.check.plan_file.folder_plan`); shared:
    pass 2's tensors from `sessions.shared_arena`, which keeps what it grew to: pass 2 runs
    last, after `ref`'s passes."""
    head = spec.head
    if mxfp6 is not None and head and mxfp6_weights.stored(head, checkpoint.tensors[head].shape):
        raise ValueError(f"{spec.name}: --mxfp6 layer by layer reads the output head {head!r} "
                         "by rows unrounded; check this graph whole (--whole)")  # fmt: skip
    g = _graph(spec, model, checkpoint)
    retained = {b for _, b in spec.retained}

    def store(name, x):
        return numerics.store(x, kv) if kv is not None and name in retained else x

    with tempfile.TemporaryDirectory(prefix="precision.") as spill:
        log(f"  {spec.name}: float32 reference")
        exact = _exact(g, feed, spill)
        collected(spec, checkpoint)
        ref_err, records = _ref_device(g, feed, precision, exact, store, log, mxfp6, plan[1])
        collected(spec, checkpoint)
        log(f"  {spec.name}: onnx in {precision}")
        onnx_max, onnx_bad, onnx_err = _onnx_device(g, folder, feed, precision, exact, store,
                                                    log, mxfp6, plan[0], shared)  # fmt: skip
        del exact
    errors = [(t.name, ref_err[t.name], onnx_err[t.name]) for t in spec.outputs]
    bad = numerics.first_nonfinite(records)
    return layer_peaks(records), onnx_max, bad, onnx_bad, errors
