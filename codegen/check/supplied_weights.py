"""Checkpoint weights handed to onnxruntime by the layer-by-layer runner (`segments.Runner`)
instead of read by it: a segment's initializers that are external data at a checkpoint
tensor's bytes are read into buffers reused from layer to layer (`layer_buffers.Buffers`,
a sparse file's holes zeroed, not read: `weights.safetensors.pread_into`) and given to the
session (`SessionOptions.add_initializer`; a float32 or float16 one is used in place, a
bfloat16 one copied). onnxruntime reading them itself cost a 31B decode layer of the sparse
benchmark checkpoint 2.5 s a pass, most of it the kernel zero-filling holes."""

import dataclasses
import os

import numpy as np
import onnx
import onnxruntime as ort

from codegen.check.layer_buffers import Buffers
from codegen.folder.external import WeightError, onnx_dtype

_IN_PLACE = (np.dtype(np.float32), np.dtype(np.float16))  # numpy types onnxruntime shares


def same_bytes(tensor, info, folder):
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


class Supplier:
    """Reads a segment's checkpoint initializers for one pass over a graph (see the module)."""

    def __init__(self, folder, checkpoint):
        self.folder, self.checkpoint, self.buffers = folder, checkpoint, Buffers()
        self.at = {}  # (file, offset) → checkpoint name
        for name, info in checkpoint.tensors.items():
            self.at[(os.path.realpath(info.file), info.offset)] = name

    def checkpoint_name(self, tensor):
        """The checkpoint tensor whose bytes initializer `tensor` is, or None."""
        where = {e.key: e.value for e in tensor.external_data}
        if tensor.data_location != onnx.TensorProto.EXTERNAL or "location" not in where:
            return None
        place = os.path.realpath(os.path.join(self.folder, where["location"]))
        name = self.at.get((place, int(where.get("offset", 0))))
        info = None if name is None else self.checkpoint.tensors[name]
        return name if info is not None and same_bytes(tensor, info, self.folder) else None

    def values(self, model):
        """{initializer name: OrtValue} of `model`'s checkpoint initializers; the arrays
        behind them stay in use (not handed out again) while the values are alive."""
        self.buffers.reclaim()
        out = {}
        for tensor in model.graph.initializer:
            name = self.checkpoint_name(tensor)
            if name is None:
                continue
            a = self.buffers.read(self.checkpoint, name, self.checkpoint.tensors[name].np_dtype)
            if a.dtype in _IN_PLACE:
                out[tensor.name] = (ort.OrtValue.ortvalue_from_numpy(a), a)
            else:
                raw = a.view(f"u{a.dtype.itemsize}")
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, tensor.data_type)
                out[tensor.name] = (value, a)
        return out


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
        if source in inits and info is not None and same_bytes(inits[source], info, folder):
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
