"""One graph's files in the export folder: traced, its weights bound (external data or graph
inputs), written and checked, with its specializations.json and custom_io.yaml beside it;
and what the graphs' manifest entries say together (`retained_layout`)."""

import json
import os
import time

from codegen.check import structure as checks
from codegen.export import qaic
from codegen.folder import external
from codegen.folder.manifest import Graph, Tensor
from codegen.folder.sessions import atomic_text
from codegen.lower.clip import clip_fp16
from codegen.lower.trace import trace


def _function_names(model):
    """The names of the ONNX functions `model` holds, sorted."""
    return sorted({f.name for f in model.functions})


def _io_entry(tensor, specializations):
    """The manifest's entry of one graph input or output, with its shape per specialization."""
    return Tensor(
        name=tensor.name,
        dtype=tensor.dtype,
        shape=list(tensor.shape),
        shapes={s["name"]: list(tensor.concrete(s["symbols"])) for s in specializations},
    )


def write_graph(spec, checkpoint, folder, opts, log):
    """Trace, bind weights, write and check one graph; returns its manifest entry (a
    `codegen.folder.manifest.Graph`)."""
    shapes = {n: info.shape for n, info in checkpoint.tensors.items()}
    t0 = time.perf_counter()
    want = checks.no_unclamped_dynamic_slice(spec, shapes)
    model = trace(spec, checkpoint.tensors)
    traced = time.perf_counter() - t0
    weight_spec = None
    if opts.weights == "external":
        external.externalize(model, spec.weights, checkpoint.tensors, checkpoint.dir)
    else:
        weight_spec = f"{spec.name}.weights.json"
        ws = external.as_inputs(model, spec.weights, checkpoint.tensors, spec.name, checkpoint.dir)
        atomic_text(os.path.join(folder, weight_spec), json.dumps(ws, indent=2) + "\n")
    clipped = clip_fp16(model, spec.weights, checkpoint.read) if opts.clip_fp16 else None
    path = os.path.join(folder, f"{spec.name}.onnx")
    data = model.SerializeToString(deterministic=True)
    atomic_text(path, data)
    t1 = time.perf_counter()
    checks.checker(model)
    checks.external_paths(model, folder)
    checks.allowed_ops(model)
    checks.inferred_shapes(model, spec, want)
    checked = time.perf_counter() - t1
    atomic_text(
        os.path.join(folder, f"{spec.name}.specializations.json"),
        qaic.specializations_json(spec.specializations, legacy=opts.legacy_specializations),
    )
    if spec.retained:
        atomic_text(
            os.path.join(folder, f"{spec.name}.custom_io.yaml"),
            qaic.custom_io_yaml(spec.retained, opts.kv_dtype),
        )
    log(
        f"  {spec.name}: traced {traced:.1f} s, checked {checked:.1f} s, "
        f"{len(data) / 1e6:.2f} MB, {len(model.graph.node)} nodes, "
        f"functions {_function_names(model) or 'none'}"
    )
    return Graph(
        name=spec.name,
        file=f"{spec.name}.onnx",
        kind=spec.kind,
        options=spec.options,
        weights_mode=opts.weights,
        clip_fp16=clipped,
        weight_spec=weight_spec,
        sub_functions=bool(model.functions),
        functions=_function_names(model),
        nodes=len(model.graph.node),
        onnx_bytes=len(data),
        trace_s=round(traced, 3),
        inputs=tuple(_io_entry(t, spec.specializations) for t in spec.inputs),
        outputs=tuple(_io_entry(t, spec.specializations) for t in spec.outputs),
        weights=list(spec.weights),
        specializations=list(spec.specializations),
        retained_state=[list(p) for p in spec.retained],
    )


def retained_layout(entries):
    """The KV-cache layout the exported language graphs share: {input name: shape} of every
    retained-state input, at the language (else decode, else prefill) graph's first
    specialization — what a prefill-only and a decode-only export must agree on to hand the
    cache over."""
    for kind in ("language", "decode", "prefill"):
        for e in entries:
            if e.kind == kind:
                retained = {pair[0] for pair in e.retained_state}
                spec = e.specializations[0]["name"]
                return {t.name: t.shapes[spec] for t in e.inputs if t.name in retained}
    return None
