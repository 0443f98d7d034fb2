"""What the device will compute, before compiling: `verify --precision` (`drift`, the same
device model over generated tokens, is `codegen.check.drift`).

It runs the device model of `ref.numerics` (every tensor stored in the compute format, each
operation computing at float32 from stored operands and rounding once; the KV cache stored
in `--kv-dtype` between steps). `verify --precision` runs it twice per graph and
specialization, on `verify`'s sample inputs: on `ref` (the exported composition's jaxpr,
`ref.numerics.probe`, named by module path) and on the exported ONNX graph itself (functions
inlined, a rounding Cast pair after every float tensor, every tensor an output, in
onnxruntime float32 — named by ONNX tensor). What it proves: under that model of the device,
on these inputs, no tensor of the graph QAIC compiles leaves the format's range (or names
the first that does), with the headroom left per layer and the error to float32. What it
cannot prove: that QAIC keeps no op in another precision, or inputs unlike these.
"""

import dataclasses
import zlib
from functools import partial

import jax
import numpy as np

from codegen import graphs
from codegen.check import mxfp6_weights
from codegen.check.device_graph import (
    device_session,
    first_nonfinite_onnx,
    formats,
    inline,
    layer_peaks,
    stats_of,
)
from codegen.check.layer_buffers import float32_bytes
from codegen.check.layered_precision import precision_specialization
from codegen.check.layerwise import error
from codegen.check.plan_file import folder_plan, instances
from codegen.check.spawned import spawned, to_stderr
from codegen.check.verify import opened, way
from ref import numerics

# --- verify --precision ----------------------------------------------------------------------


def verify_precision(
    folder, precision, *, kv_dtype=None, seed=0, check_shards=True, layerwise_given=None,
    log=None, graphs=None, specializations=None, mxfp6=None, npi=True, isolate=False,
):  # fmt: skip
    """Every graph and specialization of an export in `precision` (KV inputs and retained
    outputs stored as `kv_dtype`) → list of results, one dict per (graph, specialization):
    layers [(layer, max |x|)], onnx_max, first nonfinite (ref: Record or None; onnx: name or
    None), errors [(output, ref rel err, onnx rel err)] against float32 `ref`, way ("whole
    graph" or "layer by layer", chosen as `verify` chooses: `codegen.check.verify.way`). log(line):
    progress; graphs, specializations: the names of those to check (default all); mxfp6: an
    MXFP6 element format (`ref.mxfp6`): the device side's matmul weights stored in it on both
    sides (`codegen.check.mxfp6_weights`), the float32 reference's as the checkpoint holds
    them; npi: honour each graph's node-precision plan in the folder (GRAPH.npi.yaml, and
    GRAPH.npi.ref.json for `ref`'s side: `codegen.check.plan_file.folder_plan`), as
    compile.sh passes it, its note in the result's "plan". isolate: each graph checked layer by
    layer in a process of its own (`isolated`), its progress lines on standard error instead
    of `log`."""
    options = dict(kv_dtype=kv_dtype, seed=seed, layerwise_given=layerwise_given, mxfp6=mxfp6,
                   npi=npi)  # fmt: skip
    if isolate:
        return isolated(folder, precision, check_shards, graphs, specializations, options, log)
    return _checked(*opened(folder, check_shards, graphs, specializations), precision, options,
                    log)  # fmt: skip


def isolated(folder, precision, check_shards, graphs, specializations, options, log):
    """`verify_precision` with each graph checked layer by layer because of its size (its
    float32 weights over `verify.LAYERWISE_BYTES`; its specializations chosen here) in a process
    of its own (`spawned.spawned`), so that what its check leaves behind ends with it:
    onnxruntime's shared arena (pass 2 allocates from it there: `sessions.shared_arena`),
    XLA's compiled layers, the buffers of the largest layer. Graphs checked whole, and small
    ones forced layer by layer, run here (a child's imports and compiles cost more than they
    leave behind)."""
    folder, checkpoint, chosen = opened(folder, check_shards, graphs, specializations)
    results = []
    for entry, spec, model in chosen:
        layered = way(spec, entry, model, checkpoint, options["layerwise_given"]) == "layers"
        if not layered or way(spec, entry, model, checkpoint) != "layers":
            results += _checked(folder, checkpoint, [(entry, spec, model)], precision, options,
                                log)  # fmt: skip
            continue
        specs = [s["name"] for s in spec.specializations]
        child = {**options, "layerwise_given": True}  # as chosen here
        results += spawned(_child, folder, precision, entry.name, specs, child,
                           weights=float32_bytes(spec, checkpoint))  # fmt: skip
    return results


def _child(folder, precision, graph, specializations, options):
    """One `isolated` process (`spawned.spawned`): the graph's check, progress on standard
    error."""
    return _checked(*opened(folder, False, [graph], specializations), precision, options,
                    to_stderr, shared=True)  # fmt: skip


def _checked(folder, checkpoint, chosen, precision, options, log, shared=False):
    """`verify_precision` of the `opened` graphs `chosen`, in this process; shared: pass 2's
    tensors from `sessions.shared_arena` (a process of its own: `isolated`)."""
    kv_dtype, seed, mxfp6 = options["kv_dtype"], options["seed"], options["mxfp6"]
    precision, kv = formats(precision, kv_dtype)
    log = log or (lambda line: None)
    results = []
    # each spec's fn: the composition exported (vision tiles included: their order is in it)
    for entry, spec, model in chosen:
        layered = way(spec, entry, model, checkpoint, options["layerwise_given"]) == "layers"
        log(f"verify --precision {precision} {spec.name}: "
            f"{'layer by layer' if layered else 'whole graph'}")  # fmt: skip
        *plan, note = folder_plan(folder, spec.name, model) if options["npi"] else ([], [], None)
        if note is not None:
            log(f"  {note}")
        check = partial(_layered, shared=shared) if layered else _whole
        found_all = check(spec, entry, model, folder, checkpoint, precision, kv, seed, log, mxfp6,
                          plan)  # fmt: skip
        for s, found in found_all:
            results.append(
                {
                    "graph": spec.name,
                    "specialization": s["name"],
                    **found,
                    "clipped": entry.clipped,
                    "plan": note,
                    "way": "layer by layer" if layered else "whole graph",
                }
            )
    return results


def whole_ref_first(spec, checkpoint, precision, mxfp6):
    """first(feed, keep) for `npi.RefPlan`: `ref`'s device model of the whole graph on feed
    with the `Record.key`s keep in float32 → the first Record that turns non-finite, or
    None."""
    weights = [checkpoint.read(n).astype(np.float32) for n in spec.weights]
    stored = mxfp6_weights.weights(spec.weights, weights, mxfp6)

    def first(feed, keep):
        feed = graphs.drawn_feed(feed)
        given = [feed[t.name] for t in spec.inputs]
        with graphs.layer_scope():
            _, records = numerics.probe(spec.fn, precision, *given, *stored, keep=keep)
        return numerics.first_nonfinite(records)

    return first


def sample_feeds(spec, seed, kv):
    """(specialization, its sample inputs with the retained ones stored as `kv`)."""
    for s in spec.specializations:
        rng = np.random.default_rng([seed, zlib.crc32(f"{spec.name}/{s['name']}".encode())])
        yield s, stored_feed(spec, spec.sample(s["symbols"], rng), kv)


def stored_feed(spec, feed, kv):
    """`feed` with the graph's retained inputs as the KV cache stores them in format kv (None:
    as they are)."""
    if kv is None:
        return feed
    retained_in = {a for a, _ in spec.retained}
    return {k: _stored(v, kv) if k in retained_in else v for k, v in feed.items()}


def _stored(x, kv):
    """x (an array or `graphs.Drawn`) as the KV cache stores it in format kv."""
    if isinstance(x, graphs.Drawn):
        return dataclasses.replace(x, then=partial(numerics.store, kv_format=kv))
    return np.asarray(numerics.store(x, kv))


def _layered(spec, entry, model, folder, checkpoint, precision, kv, seed, log, mxfp6, plan,
             shared=False):  # fmt: skip
    for s, feed in sample_feeds(spec, seed, kv):
        layers, onnx_max, ref_bad, onnx_bad, errors = precision_specialization(
            spec, model, folder, checkpoint, feed, precision, kv, log, mxfp6, plan, shared
        )
        yield s, {"layers": layers, "onnx_max": onnx_max, "ref_nonfinite": ref_bad,
                  "onnx_nonfinite": onnx_bad, "errors": errors}  # fmt: skip


def _whole(spec, entry, model, folder, checkpoint, precision, kv, seed, log, mxfp6, plan):
    producers = {o: n for n in inline(model).graph.node for o in n.output}
    model = mxfp6_weights.stored_model(model, checkpoint, mxfp6)
    kept = instances(model, plan[0])
    session, names = device_session(model, entry, folder, precision, kept)
    weights = [checkpoint.read(n).astype(np.float32) for n in spec.weights]
    stored = mxfp6_weights.weights(spec.weights, weights, mxfp6)
    retained_out = {b for _, b in spec.retained}
    for s, feed in sample_feeds(spec, seed, kv):
        feed = graphs.drawn_feed(feed)
        given = [feed[t.name] for t in spec.inputs]
        with graphs.layer_scope():
            exact = jax.jit(spec.fn)(*given, *weights)
            low, records = numerics.probe(spec.fn, precision, *given, *stored, keep=plan[1])
        names_out = [o.name for o in session.get_outputs()]
        got = dict(zip(names_out, session.run(None, feed), strict=True))
        errors = []
        for t, want, mine in zip(spec.outputs, exact, low, strict=True):
            theirs = got[t.name]
            if kv is not None and t.name in retained_out:
                mine, theirs = numerics.store(mine, kv), numerics.store(theirs, kv)
            errors.append((t.name, error(mine, want)[1], error(theirs, want)[1]))
        stats = stats_of(got, names)
        rounded = [st[0] for n, st in stats.items() if n not in kept]
        yield (
            s,
            {
                "layers": layer_peaks(records),
                "onnx_max": max(rounded, default=0.0),
                "ref_nonfinite": numerics.first_nonfinite(records),
                "onnx_nonfinite": first_nonfinite_onnx(stats, names, producers),
                "errors": errors,
            },
        )


def table(head, rows):
    """Rows of cells as left-aligned text columns, the head first."""
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]
    )


def precision_table(results, precision, mxfp6=None):
    """The `verify --precision` report: per graph, specialization and layer the largest |x|
    and the headroom to the format's largest finite value; the first non-finite tensor; the
    outputs' relative error to float32 (`ref` in the format, and the ONNX graph in it; with
    the matmul weights as MXFP6 with element `mxfp6` when given)."""
    precision = numerics.format_name(precision)
    top = numerics.finite_max(precision)

    def headroom(peak):
        return f"{top / peak:.3g}x" if peak else "-"

    layer_rows, error_rows, bad, notes = [], [], [], []
    for r in results:
        where = (r["graph"], r["specialization"])
        layer_rows += [
            (*where, name or "(outside modules)", f"{peak:.4g}", headroom(peak))
            for name, peak in r["layers"]
        ]
        layer_rows.append((*where, "(onnx, every tensor)", f"{r['onnx_max']:.4g}",
                           headroom(r["onnx_max"])))  # fmt: skip
        error_rows += [(*where, o, f"{a:.2e}", f"{b:.2e}") for o, a, b in r["errors"]]
        ref_bad, onnx_bad = r["ref_nonfinite"], r["onnx_nonfinite"]
        if ref_bad is not None:
            line = (
                f"{r['graph']}/{r['specialization']}: ref: {ref_bad.primitive} "
                f"{list(ref_bad.shape)} in {ref_bad.name or '(top)'} turns non-finite"
            )
            # an --clip-fp16 export: ref has no clamps, the graph's own verdict is the onnx one
            (notes if r["clipped"] else bad).append(line)
        if onnx_bad is not None:
            bad.append(f"{r['graph']}/{r['specialization']}: onnx: tensor {onnx_bad} "
                       "turns non-finite")  # fmt: skip
    plans = dict.fromkeys(r["plan"] for r in results if r.get("plan"))
    text = [
        f"{precision}: largest finite {top:g}"
        + ("" if mxfp6 is None else f"; matmul weights as MXFP6 ({mxfp6})"),
        *(f"plan {note}" for note in plans),
        table(("graph", "specialization", "layer", "max |x|", "headroom"), layer_rows),
        "",
        table(
            ("graph", "specialization", "output", f"ref {precision} err", f"onnx {precision} err"),
            error_rows,
        ),
    ]
    text += ["", *bad] if bad else ["", f"no tensor of the graphs leaves the {precision} range"]
    text += [f"{n} (clamped in the graph by --clip-fp16)" for n in notes]
    return "\n".join(text), bad
