"""What the device will compute, before compiling: `verify --precision` (`drift`, the same
device model over generated tokens, is `codegen.drift`).

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
import os
import zlib
from functools import partial

import jax
import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper

from codegen import graphs
from codegen.folder import session_at
from codegen.layerwise import error
from codegen.verify import opened, way
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


# --- the exported graph in the device's format ---------------------------------------------


def _float_tensors(model):
    """Names of the float32 tensors of an inlined model: its float inputs, then every node's
    float outputs in node order (types from ONNX shape inference)."""
    inferred = onnx.shape_inference.infer_shapes(model)
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


STATS = ("peak", "nan", "bad")  # per probed tensor: max finite |x|, any NaN, any non-finite


def _stat_nodes(name):
    """Nodes making `name/peak` (its largest finite |x|, 0 when none), `name/nan` and
    `name/bad` (1.0 when any element is NaN / non-finite, else 0.0): float scalars, so a
    probed tensor is read as three numbers, not held (a zero is appended: empty tensors
    reduce too)."""

    def node(op, inputs, out, **attrs):
        ins = [i if i.startswith("stats/") or i == name else f"{name}/{i}" for i in inputs]
        return helper.make_node(op, ins, [f"{name}/{out}"], name=f"{name}/{out}", **attrs)

    return [
        node("Reshape", [name, "stats/flat"], "flat"),
        node("Concat", ["flat", "stats/zero"], "padded", axis=0),
        node("IsNaN", ["padded"], "isnan"),
        node("IsInf", ["padded"], "isinf"),
        node("Or", ["isnan", "isinf"], "isbad"),
        node("Abs", ["padded"], "abs"),
        node("Where", ["isbad", "stats/zero", "abs"], "finite"),
        node("ReduceMax", ["finite"], "peak", keepdims=0),
        node("Cast", ["isnan"], "nanf", to=TensorProto.FLOAT),
        node("ReduceMax", ["nanf"], "nan", keepdims=0),
        node("Cast", ["isbad"], "badf", to=TensorProto.FLOAT),
        node("ReduceMax", ["badf"], "bad", keepdims=0),
    ]


def device_graph(model, precision, keep=frozenset(), stats=True):
    """The exported graph as the device computes it: functions inlined, every float32 input
    and node result rounded to `precision` by a Cast pair — but the node results named in
    `keep` (a node-precision plan: QAIC's FP32NodeInstanceNames), which stay float32 — and
    three scalar outputs per node result (`_stat_nodes`: `name/peak`, `name/nan`,
    `name/bad`; none when `stats` is False: the graph's own outputs only). model: an onnx
    ModelProto (external data not loaded) → (ModelProto, probed tensor names in node order,
    the names of their scalar outputs)."""
    model = inline(model)
    inputs, made = _float_tensors(model)
    to = _ONNX_TYPES[precision]
    graph = model.graph
    renamed = {name: f"{name}/exact" for name in inputs}
    for node in graph.node:
        node.input[:] = [renamed.get(i, i) for i in node.input]
        node.output[:] = [f"{o}/exact" if o in made else o for o in node.output]
    nodes = list(graph.node)
    rounding = {}
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
    for node in nodes:
        ordered.append(node)
        for o in node.output:
            if o.endswith("/exact"):
                ordered += rounding[o[:-6]] + (_stat_nodes(o[:-6]) if stats else [])
    del graph.node[:]
    graph.node.extend(ordered)
    graph.initializer.extend(
        [
            helper.make_tensor("stats/flat", TensorProto.INT64, [1], [-1]),
            helper.make_tensor("stats/zero", TensorProto.FLOAT, [1], [0.0]),
        ]
    )
    outputs = [f"{n}/{stat}" for n in made for stat in STATS] if stats else []
    graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, []) for o in outputs)
    return model, made, outputs


def stats_of(got, names):
    """{name: (largest finite |x|, any NaN, all finite)} from a device graph's scalar
    outputs `got` ({output name: value})."""
    return {
        n: (float(got[f"{n}/peak"]), bool(got[f"{n}/nan"]), not bool(got[f"{n}/bad"]))
        for n in names
    }


def _device_session(model, entry, folder, precision, keep=frozenset()):
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
        if nan or (
            not finite[name] and not clamped and all(finite.get(i, True) for i in node.input)
        ):
            return name
    return None


# --- verify --precision ----------------------------------------------------------------------


def verify_precision(
    folder, precision, *, kv_dtype=None, seed=0, check_shards=True, layerwise_given=None,
    log=None, graphs=None, specializations=None,
):  # fmt: skip
    """Every graph and specialization of an export in `precision` (KV inputs and retained
    outputs stored as `kv_dtype`) → list of results, one dict per (graph, specialization):
    layers [(layer, max |x|)], onnx_max, first nonfinite (ref: Record or None; onnx: name or
    None), errors [(output, ref rel err, onnx rel err)] against float32 `ref`, way ("whole
    graph" or "layer by layer", chosen as `verify` chooses: `codegen.verify.way`). log(line):
    progress; graphs, specializations: the names of those to check (default all)."""
    precision, kv = formats(precision, kv_dtype)
    log = log or (lambda line: None)
    folder, checkpoint, chosen = opened(folder, check_shards, graphs, specializations)
    results = []
    # each spec's fn: the composition exported (vision tiles included: their order is in it)
    for entry, spec, model in chosen:
        layered = way(spec, entry, model, checkpoint, layerwise_given) == "layers"
        log(f"verify --precision {precision} {spec.name}: "
            f"{'layer by layer' if layered else 'whole graph'}")  # fmt: skip
        check = _layered if layered else _whole
        for s, found in check(spec, entry, model, folder, checkpoint, precision, kv, seed, log):
            results.append(
                {
                    "graph": spec.name,
                    "specialization": s["name"],
                    **found,
                    "clipped": entry.clipped,
                    "way": "layer by layer" if layered else "whole graph",
                }
            )
    return results


def formats(precision, kv_dtype):
    """(compute format, KV storage format or None), their canonical names (`fp16` → float16)."""
    kv = None if kv_dtype is None else numerics.format_name(kv_dtype, numerics.KV_FORMATS)
    return numerics.format_name(precision), kv


def _feeds(spec, seed, kv):
    """(specialization, its sample inputs with the retained ones stored as `kv`)."""
    retained_in = {a for a, _ in spec.retained}
    for s in spec.specializations:
        rng = np.random.default_rng([seed, zlib.crc32(f"{spec.name}/{s['name']}".encode())])
        feed = spec.sample(s["symbols"], rng)
        if kv is not None:
            feed = {k: _stored(v, kv) if k in retained_in else v for k, v in feed.items()}
        yield s, feed


def _stored(x, kv):
    """x (an array or `graphs.Drawn`) as the KV cache stores it in format kv."""
    if isinstance(x, graphs.Drawn):
        return dataclasses.replace(x, then=partial(numerics.store, kv_format=kv))
    return np.asarray(numerics.store(x, kv))


def _layered(spec, entry, model, folder, checkpoint, precision, kv, seed, log):
    from codegen.layered_precision import precision_specialization

    for s, feed in _feeds(spec, seed, kv):
        layers, onnx_max, ref_bad, onnx_bad, errors = precision_specialization(
            spec, model, folder, checkpoint, feed, precision, kv, log
        )
        yield s, {"layers": layers, "onnx_max": onnx_max, "ref_nonfinite": ref_bad,
                  "onnx_nonfinite": onnx_bad, "errors": errors}  # fmt: skip


def _whole(spec, entry, model, folder, checkpoint, precision, kv, seed, log):
    session, names = _device_session(model, entry, folder, precision)
    producers = {o: n for n in inline(model).graph.node for o in n.output}
    weights = [checkpoint.read(n).astype(np.float32) for n in spec.weights]
    retained_out = {b for _, b in spec.retained}
    for s, feed in _feeds(spec, seed, kv):
        feed = graphs.drawn_feed(feed)
        args = [feed[t.name] for t in spec.inputs] + weights
        with graphs.layer_scope():
            exact = jax.jit(spec.fn)(*args)
            low, records = numerics.probe(spec.fn, precision, *args)
        names_out = [o.name for o in session.get_outputs()]
        got = dict(zip(names_out, session.run(None, feed), strict=True))
        errors = []
        for t, want, mine in zip(spec.outputs, exact, low, strict=True):
            theirs = got[t.name]
            if kv is not None and t.name in retained_out:
                mine, theirs = numerics.store(mine, kv), numerics.store(theirs, kv)
            errors.append((t.name, error(mine, want)[1], error(theirs, want)[1]))
        layers = {}
        for r in records:
            key = layer_of(r.name)
            layers[key] = max(layers.get(key, 0.0), r.max_abs)
        stats = stats_of(got, names)
        yield (
            s,
            {
                "layers": list(layers.items()),
                "onnx_max": max((st[0] for st in stats.values()), default=0.0),
                "ref_nonfinite": next((r for r in records if r.nonfinite), None),
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


def precision_table(results, precision):
    """The `verify --precision` report: per graph, specialization and layer the largest |x|
    and the headroom to the format's largest finite value; the first non-finite tensor; the
    outputs' relative error to float32 (`ref` in the format, and the ONNX graph in it)."""
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
    text = [
        f"{precision}: largest finite {top:g}",
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
