"""A measured node-precision plan: the node outputs QAIC must keep in float32 for a graph to
stay finite in float16 (`verify --precision fp16 --write-npi`), written as the compiler's
node-precision-info YAML (`FP32NodeInstanceNames:`), which compile.sh passes as
`-node-precision-info` when the file is there.

The search, per graph, over every specialization's calibration inputs (verify's drawn ones):
run the device graph (`device_graph.device_graph`: every float tensor rounded to the format
except the plan's), take the first tensor that turns non-finite (`first_nonfinite_name`), keep
it in float32, run again, until nothing turns non-finite. Each kept node is the one the device
would otherwise overflow first, so the plan holds only nodes that overflow given the ones
before them — a small set, not a proven minimum. QEfficient decides by rule instead: every
non-MatMul node output of the decoder layers in float32 (its E2B file lists 4,010), every Add
and RMSNorm of the vision tower.

Calibration inputs: verify's drawn ones per specialization, or the graph calls of the user's
requests (`--prompts FILE`, `codegen.check.calibration`). A graph `verify` checks layer by
layer (a released size, or `--layerwise`) is searched the same way segment by segment
(`plan_layers`: one layer's weights held at a time, each run stopped at its first non-finite
tensor). Names are those of the inlined graph (a node inside a layer function is named as
onnx's inliner names it), each checked to exist there. `ref`'s device model is searched
beside the graph's (`RefPlan`): each node is paired with the tensor `ref` overflows first,
written to GRAPH.npi.ref.json (`codegen.check.plan_file`), so that `verify --precision`
keeps the plan in both device models.
"""

import re

from codegen.check import calibration, mxfp6_weights, plan_file
from codegen.check.device_graph import (
    device_session,
    first_nonfinite_name,
    formats,
    inline,
    stats_of,
)
from codegen.check.layer_buffers import float32_bytes
from codegen.check.layered_precision import plan_search, ref_first
from codegen.check.plan_file import SUFFIX, PlanError, write_plan
from codegen.check.precision import sample_feeds, stored_feed, whole_ref_first
from codegen.check.spawned import spawned, to_stderr
from codegen.check.verify import opened, way
from codegen.folder.opened import open_folder
from codegen.graphs import drawn_feed
from ref import numerics

MOST = 64  # nodes a plan may add before the search gives up


# ONNX ops and the other ref primitives that make the same tensor (any op: its own name in
# lower case): jax2onnx lowers an integer power to products (GELU's x³ = (x·x)·x, whose last
# Mul is ref's integer_pow), a mean to one ReduceMean (ref's div; its sum is no tensor)
_SAME_OP = {
    "MatMul": {"dot_general"},
    "Gemm": {"dot_general"},
    "Mul": {"integer_pow"},
    "Pow": {"integer_pow"},
    "ReduceMean": {"div"},
    "Where": {"select_n"},
    "Cast": {"convert_element_type"},
    "Expand": {"broadcast_in_dim"},
}


def same_operation(op, primitive):
    """True when ONNX op `op` and jaxpr primitive `primitive` make the same tensor."""
    return primitive == op.lower() or primitive in _SAME_OP.get(op, ())


def layer_of_call(call):
    """The layer index a function call computes, read from its checkpoint weights' names
    (`…layers.N.…`), or None where they name no single layer."""
    found = {m.group(1) for i in call.input for m in [_LAYER.search(i)] if m}
    return int(found.pop()) if len(found) == 1 else None


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?=[.:])")


def every_call(model):
    """spread(name, key) → the `ref` keys of a plan's node in every call: a body name (kept
    in every call of its function, as the compiler reads it) gives `key` (one layer's
    `ref.numerics.Record.key`, `…layers.N…:op#k`) in each layer its function computes; a
    top-level name, or a key naming no layer the function computes, gives [key]."""
    layers = {}
    for _, call, f in plan_file.function_calls(model):
        layers.setdefault(f.name, []).append(layer_of_call(call))

    def spread(name, key):
        where = plan_file.calls_of(model, name)
        found = _LAYER.search(key.split(":", 1)[0] + ":")
        mine = layers.get(where[0], []) if where else []
        if found is None or int(found.group(1)) not in mine or None in mine:
            return [key]
        at = found.span(1)
        return [key[: at[0]] + str(n) + key[at[1] :] for n in mine]

    return spread


class RefPlan:
    """`ref`'s side of a plan, searched beside the graph's, node for node: on the same input,
    the tensor `ref`'s device model turns non-finite first (with the tensors paired so far
    kept in float32) is paired with the graph's node when both compute the same operation
    (`same_operation`), and its `ref.numerics.Record.key` is kept, in every layer the graph's
    node is kept in (`every_call`). Where the two device models part (another operation, or
    only one overflows), pairing stops and `parted` says where; the graph's plan goes on
    alone (it is what QAIC reads)."""

    def __init__(self, first, spread=None):
        """first(feed, keep) → the first Record `ref`'s device model turns non-finite on
        `feed` with the keys `keep` in float32, or None; spread(name, key) → the keys of the
        plan's node `name` in every call (`every_call`; None: [key])."""
        self.first, self.keep, self.parted = first, [], None
        self.spread = spread or (lambda name, key: [key])

    def pair(self, label, feed, node=None):
        """`ref`'s keys for the graph's first non-finite node (plan name, op) on `feed` (None:
        the graph stays finite there) → the keys kept, or None."""
        if self.parted is not None:
            return None
        record = self.first(feed, tuple(self.keep))
        if node is None and record is None:
            return None
        if node is not None and record is not None and same_operation(node[1], record.primitive):
            keys = self.spread(node[0], record.key)
            self.keep += [k for k in keys if k not in self.keep]
            return keys
        graph = "nothing" if node is None else f"{node[0]!r} ({node[1]})"
        mine = "nothing" if record is None else f"{record.key} {list(record.shape)}"
        self.parted = f"{label}: the graph turns {graph} non-finite first, ref {mine}"
        return None


def plan_graph(entry, spec, model, folder, precision, feeds, log, ref):
    """The plan of one graph over its calibration inputs `feeds` [(label, feed)], `ref`'s side
    paired by `ref` (a `RefPlan`) → (kept names in the order found, as the compiled file names
    them (`plan_file.plan_names`: a body name keeps the node in every call), [(label, name,
    op, ref keys or None)], headroom: (the format's largest finite value over the largest |x|
    left rounded, that tensor's name))."""
    producers = {o: n for n in inline(model).graph.node for o in n.output}
    named = plan_file.plan_names(model)
    keep, found, top = [], [], (0.0, None)
    for label, feed in feeds:
        while True:
            kept = plan_file.instances(model, keep)
            session, names = device_session(model, entry, folder, precision, kept)
            out = [o.name for o in session.get_outputs()]
            got = dict(zip(out, session.run(None, drawn_feed(feed)), strict=True))
            stats = stats_of(got, names)
            bad = first_nonfinite_name(stats, names, producers)
            if bad is None:
                ref.pair(label, feed)
                rounded = [(stats[n][0], n) for n in names if n not in kept]
                top = max([top, *rounded], key=lambda t: t[0])  # ties: the first
                break
            if len(keep) == MOST:
                raise PlanError(f"{spec.name}: still non-finite after keeping {MOST} nodes")
            op, name = producers[bad].op_type, named[bad]
            if name in keep:
                raise PlanError(f"{spec.name}: {bad!r} is non-finite with {name!r} kept")
            found.append((label, name, op, ref.pair(label, feed, (name, op))))
            keep.append(name)
            log(f"{spec.name} {label}: keep {name!r} ({op}) in float32")
    ratio = numerics.finite_max(precision) / top[0] if top[0] else float("inf")
    return keep, found, (ratio, top[1])


def plan_layers(spec, model, folder, checkpoint, precision, feeds, log, mxfp6=None,
                isolate=False):  # fmt: skip
    """`plan_graph` for a graph checked layer by layer (a released size: one layer's weights
    held at a time): the device graph runs segment by segment (`searched`), then `ref`'s
    side is paired node for node, in the order the search found them (`paired`; the search
    does not read the pairing: the same plan, the same pairs as interleaved, and `ref`'s
    passes run once the search's memory is gone) → the same (kept names, found rows,
    headroom) and where `ref` parted (`RefPlan.parted`). isolate: the search and the pairing
    each in a process of its own (`spawned.spawned`)."""
    feeds = list(feeds)
    if isolate:
        log(f"{spec.name}: the device graph searched, then paired with ref, each in a "
            "process of its own")  # fmt: skip
        size = float32_bytes(spec, checkpoint)
        runs = spawned(_search_child, folder, spec.name, precision, feeds, mxfp6, weights=size)
        return spawned(_pair_child, folder, spec.name, precision, feeds, runs, mxfp6,
                       weights=size)  # fmt: skip
    runs = searched(spec, model, folder, checkpoint, precision, feeds, mxfp6)
    return paired(spec, model, checkpoint, precision, feeds, runs, log, mxfp6)


def paired(spec, model, checkpoint, precision, feeds, runs, log, mxfp6=None):
    """The plan of `searched`'s `runs` on `feeds`, each node paired with `ref`'s (a `RefPlan`
    of `layered_precision.ref_first`) → (kept names, found rows, headroom, where `ref`
    parted or None)."""
    ref = RefPlan(ref_first(spec, model, checkpoint, precision, mxfp6, log), every_call(model))
    keep, found, top = [], [], (0.0, None)
    for (label, feed), (kept, peak) in zip(feeds, runs, strict=True):
        for name, op in kept:
            found.append((label, name, op, ref.pair(label, feed, (name, op))))
            keep.append(name)
            log(f"{spec.name} {label}: keep {name!r} ({op}) in float32")
        ref.pair(label, feed)
        top = max(top, peak, key=lambda t: t[0])  # ties: the first
    ratio = numerics.finite_max(precision) / top[0] if top[0] else float("inf")
    return keep, found, (ratio, top[1]), ref.parted


def searched(spec, model, folder, checkpoint, precision, feeds, mxfp6=None, shared=False):
    """The device graph's plan search over `feeds` [(label, feed)] in turn, segment by
    segment (`layered_precision.plan_search`: a segment that makes a non-finite tensor runs
    again with it kept, the run going on from there; each feed starts from the nodes kept
    before it) → per feed ([(name, op)] kept there, in the order found; (largest finite |x|
    left rounded, its name)). The names one specialization's run found in need of full
    statistics (a mask's −inf) get them from the start at the next: its first call of each
    layer function is not run twice. shared: as `plan_search`'s."""
    keep, full, runs = [], set(), []
    for _, feed in feeds:
        kept = []

        def on_keep(name, op, kept=kept):
            if len(keep) > MOST:
                raise PlanError(f"{spec.name}: still non-finite after keeping {MOST} nodes")
            kept.append((name, op))

        peak = plan_search(spec, model, folder, checkpoint, feed, precision, keep, on_keep,
                           mxfp6, full, shared)  # fmt: skip
        runs.append((kept, peak))
    return runs


def _search_child(folder, graph, precision, feeds, mxfp6):
    """`searched` in a process of its own, its segments' tensors from onnxruntime's shared
    arena (`sessions.shared_arena`), which ends with it: the freed score tiles of a vision
    layer are reused instead of mapped and zero-filled anew (an E4B vision layer at 10,080
    patches: 25 s, 12 s of them the kernel's, without it; 13 s with it), and nothing it grew
    to stays behind for `ref`'s passes."""
    folder, checkpoint, [(_, spec, model)] = opened(folder, False, [graph])
    return searched(spec, model, folder, checkpoint, precision, feeds, mxfp6, shared=True)


def _pair_child(folder, graph, precision, feeds, runs, mxfp6):
    """`paired` in a process of its own, progress on standard error: XLA's layer programs and
    their buffers (a 26B-A4B MoE prefill layer: 3.3 GB of weights, 3.9 GB of temporaries)
    end with it."""
    folder, checkpoint, [(_, spec, model)] = opened(folder, False, [graph])
    return paired(spec, model, checkpoint, precision, feeds, runs, to_stderr, mxfp6)


def write_plans(folder, precision, *, kv_dtype=None, seed=0, check_shards=True, graphs=None,
                log=None, mxfp6=None, prompts=None, layerwise_given=None,
                specializations=None):  # fmt: skip
    """Plan every chosen graph of an export and write `<graph>.npi.yaml` beside it (a graph
    whose plan is empty gets no file, and an old one is removed) → [(graph, kept names, found
    rows, headroom)]. graphs, specializations: the names of those to plan on (default all, as
    `verify.selected` chooses; the plan then holds what those inputs overflow). mxfp6: an
    MXFP6 element format the device graph's matmul weights are stored in while planning
    (`codegen.check.mxfp6_weights`), or None; prompts: a requests
    file whose graph calls are the calibration inputs (`codegen.check.calibration`) instead
    of verify's drawn ones; layerwise_given: `verify`'s --layerwise/--whole (None: its
    default by size), a graph checked layer by layer planned by `plan_layers`."""
    precision, kv = formats(precision, kv_dtype)
    log = log or (lambda line: None)
    export = open_folder(folder, check_shards=check_shards)  # once: calibration runs on it too
    folder, checkpoint, chosen = opened(export, graphs=graphs, specializations=specializations)
    calls = None
    if prompts is not None:
        calls = calibration.recorded_feeds(export, prompts, log=log)
    plans = []
    for entry, spec, model in chosen:
        recorded = None if calls is None else _recorded(calls, entry.kind)
        if calls is None:
            feeds = ((s["name"], feed) for s, feed in sample_feeds(spec, seed, kv))
        elif recorded:
            feeds = ((label, stored_feed(spec, f, kv)) for label, f in recorded)
        else:
            raise PlanError(f"{spec.name}: no request in {prompts} calls this graph (the vision "
                            "graph needs a request with an image or a video, the audio graph "
                            "one with audios)")  # fmt: skip
        if way(spec, entry, model, checkpoint, layerwise_given) == "layers":
            log(f"{spec.name}: planned layer by layer")
            isolate = way(spec, entry, model, checkpoint) == "layers"  # by size
            keep, found, headroom, parted = plan_layers(
                spec, model, folder, checkpoint, precision, feeds, log, mxfp6, isolate
            )
        else:
            ref = RefPlan(whole_ref_first(spec, checkpoint, precision, mxfp6), every_call(model))
            device = mxfp6_weights.stored_model(model, checkpoint, mxfp6)
            keep, found, headroom = plan_graph(entry, spec, device, folder, precision, feeds,
                                               log, ref)  # fmt: skip
            parted = ref.parted
        write_plan(folder, spec.name, model, precision, found, parted)
        every = {name: plan_file.calls_of(model, name) for name in keep}
        plans.append((spec.name, keep, found, headroom, parted, every))
    return plans


def plans_table(plans, precision):
    """The report: per graph the nodes kept in float32 (where found, op; a node inside a
    layer function in each of its calls, which the compiler keeps with it) and the
    headroom."""
    lines = []
    for graph, keep, found, (ratio, tensor), parted, every in plans:
        calls = sum(every[n][1] if every[n] else 1 for n in keep)
        lines.append(
            f"{graph}: {len(keep)} node(s) in float32 ({calls} in all calls), headroom "
            f"{ratio:.4g}x in {precision} (largest rounded: {tensor!r})"
            + (f" -> {graph}{SUFFIX}" if keep else "")
        )
        for s, name, op, keys in found:
            line = f"  {s}: {name} ({op})"
            if every[name]:
                line += f" in each of {every[name][0]}'s {every[name][1]} call(s)"
            lines.append(line + (f" = ref {', '.join(keys)}" if keys else " (not paired in ref)"))
        if parted is not None:
            lines.append(f"  ref parts from the graph at {parted}")
    return "\n".join(lines)


def _recorded(calls, kind):
    """The recorded calls of a graph of `kind` ({runner kind: [(label, feed)]}): a language
    program's are the prefill and decode calls."""
    kinds = ("prefill", "decode") if kind == "language" else (kind,)
    return [call for k in kinds for call in calls.get(k, ())]
