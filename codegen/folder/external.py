"""Weights that stay in the checkpoint: ONNX initializers pointing into safetensors bytes.

No function here reads tensor data. `--weights external` turns each weight graph input into an
initializer whose external data is `(shard file, byte offset, length)` inside a shard that is
hard-linked into the output folder; `--weights inputs` keeps them as graph inputs described by
QEfficient's weight spec v5 (also embedded as ONNX metadata `com.qti.aisw.extdata`).
"""

import json
import os
import shutil

from onnx import TensorProto, helper

# safetensors dtype code → ONNX element type (what a checkpoint's weights can be). Graphs
# take every weight as float32 (a Cast after the initializer); an integer table (the MTP
# assistant's token_ordering, ids < 2^24) passes through float32 exactly, and the graph
# casts it back to int32 where `ref` does.
ONNX_DTYPES = {
    "F64": TensorProto.DOUBLE,
    "F32": TensorProto.FLOAT,
    "F16": TensorProto.FLOAT16,
    "BF16": TensorProto.BFLOAT16,
    "I64": TensorProto.INT64,
    "I32": TensorProto.INT32,
}
EXTDATA_KEY = "com.qti.aisw.extdata"


class WeightError(ValueError):
    """A checkpoint tensor cannot become an ONNX weight."""


def onnx_dtype(info):
    """ONNX element type of a checkpoint tensor (TensorInfo)."""
    if info.dtype not in ONNX_DTYPES:
        raise WeightError(
            f"tensor {info.name!r} has dtype {info.dtype}: expected one of {sorted(ONNX_DTYPES)}"
        )
    return ONNX_DTYPES[info.dtype]


def shard_name(path, root):
    """A shard's name relative to its model folder, '/'-separated (index names may hold
    subfolders, so two shards can share a base name)."""
    return os.path.relpath(path, root).replace(os.sep, "/")


def place_shards(shards, folder, root):
    """Hard-link each shard of the model folder `root` into `folder` at the same relative
    path (copy when linking fails, e.g. across filesystems).

    Returns [{"file", "bytes", "copied"}] in shard order.
    """
    placed = []
    for shard in shards:
        name = shard_name(shard, root)
        target = os.path.join(folder, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        copied = False
        try:
            os.link(os.path.realpath(shard), target)
        except OSError:
            shutil.copyfile(shard, target)
            copied = True
        placed.append({"file": name, "bytes": os.path.getsize(target), "copied": copied})
    return placed


def _cast_uses(graph, names, tensors):
    """Send the graph's uses of each non-float32 weight through a Cast to float32.

    The weight keeps its checkpoint name and dtype; its users read `name + "::f32"`.
    """
    casts = []
    rename = {}
    for name in names:
        if onnx_dtype(tensors[name]) != TensorProto.FLOAT:
            rename[name] = name + "::f32"
            casts.append(
                helper.make_node(
                    "Cast", [name], [rename[name]], to=TensorProto.FLOAT, name=f"cast/{name}"
                )
            )
    for node in graph.node:
        for i, x in enumerate(node.input):
            if x in rename:
                node.input[i] = rename[x]
    for out in graph.output:
        if out.name in rename:
            raise WeightError(f"weight {out.name!r} is also a graph output")
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)


def _bind(graph, names, tensors, root):
    """Replace the graph inputs `names` by initializers with external data in their shards;
    the location is the shard's path relative to the model folder `root` (the output folder
    holds the shards at the same relative paths, beside the .onnx file)."""
    weights = set(names)
    keep = [i for i in graph.input if i.name not in weights]
    del graph.input[:]
    graph.input.extend(keep)
    for name in names:
        info = tensors[name]
        t = TensorProto(name=name, data_type=onnx_dtype(info), dims=list(info.shape))
        t.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", shard_name(info.file, root)),
            ("offset", str(info.offset)),
            ("length", str(info.nbytes)),
        ):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        graph.initializer.append(t)


def externalize(model, names, tensors, root):
    """Weight inputs `names` → external initializers (in place); tensors: {name: TensorInfo}
    of the model folder `root`. Non-float32 weights get a Cast to float32."""
    _bind(model.graph, names, tensors, root)
    _cast_uses(model.graph, names, tensors)


def as_inputs(model, names, tensors, model_name, root):
    """Weights stay graph inputs in their checkpoint dtype; returns the weight spec v5 dict
    (also embedded as metadata `com.qti.aisw.extdata`)."""
    weights = set(names)
    for value in model.graph.input:
        if value.name in weights:
            value.type.tensor_type.elem_type = onnx_dtype(tensors[value.name])
    _cast_uses(model.graph, names, tensors)
    files = sorted({shard_name(tensors[n].file, root) for n in names})
    spec = {
        "model_name": model_name,
        "model_id": model_name,
        "files": [{"path": f, "format": "safetensors"} for f in files],
        "inputs": [
            {"name": n, "location": {"file": shard_name(tensors[n].file, root), "key": n}}
            for n in names
        ],
    }
    helper.set_model_props(model, {EXTDATA_KEY: json.dumps(spec, sort_keys=True)})
    return spec


def inputs_to_initializers(model, spec, tensors, root):
    """The verify-time view of a `--weights inputs` graph: its weight inputs bound to the bytes
    the weight spec names (the Casts are already in the graph)."""
    names = [entry["location"]["key"] for entry in spec["inputs"]]
    inputs = {i.name for i in model.graph.input}
    missing = [n for n in names if n not in inputs]
    if missing:
        raise WeightError(f"weight spec names inputs the graph lacks: {missing[:3]}")
    _bind(model.graph, names, tensors, root)
    return model
