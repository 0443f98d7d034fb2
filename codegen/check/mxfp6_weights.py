"""`verify --precision --mxfp6`: the graph's matmul weights as QAIC's `-mxfp6-matmul` stores
them, on both sides of the check.

Which weights and how: `ref.mxfp6` (OCP MX v1.0 FP6 elements, an E8M0 scale per 32 values
along the last axis, which is the reduction axis of every checkpoint matmul weight: [out, in]
linears, [E, 2I, D] and [E, D, I] experts, [E, D] router). A weight is named by its checkpoint
name, and the exported graph's initializers carry those names, so `ref`'s weight list and the
ONNX graph's initializers are rounded by the same rule: a weight of two or more dims that
`ref.mxfp6.is_matmul_weight` picks (not the embedding tables, whose tied head stays as the
checkpoint holds it, nor norms or scalars). The float32 reference keeps the checkpoint's
values: the error `verify --precision` reports is then MXFP6's and the format's together.
"""

import numpy as np
import onnx
from onnx import TensorProto, helper

from ref import mxfp6

_CHECKPOINT_TYPES = {
    TensorProto.FLOAT: np.float32,
    TensorProto.FLOAT16: np.float16,
}


def stored(name, shape):
    """Whether checkpoint tensor `name` of `shape` is a matmul weight QAIC stores as MXFP6."""
    return len(shape) >= 2 and mxfp6.is_matmul_weight(tuple(name.split(".")))


def as_stored(x, element):
    """x (any float array) read back from MXFP6 with `element` → float32 array."""
    return np.asarray(mxfp6.round_trip(np.asarray(x, np.float32), element))


def weights(names, arrays, element):
    """`arrays` (a weight list in `names`' order) with each stored matmul weight as MXFP6
    holds it (float32), the others as they were; element None: unchanged."""
    if element is None:
        return list(arrays)
    return [as_stored(a, element) if stored(n, np.shape(a)) else a
            for n, a in zip(names, arrays, strict=True)]  # fmt: skip


def _tensor(name, values, like):
    """An in-memory initializer `name` holding float32 `values`: in `like`'s element type when
    that holds them exactly (bfloat16 holds every MXFP6 value of a bfloat16 weight), else
    float32 (the graph's Cast to float32 then changes nothing)."""
    if like.data_type == TensorProto.BFLOAT16:
        bits = values.view(np.uint32)
        if not np.any(bits & 0xFFFF):
            data = (bits >> 16).astype(np.uint16)
            return helper.make_tensor(name, TensorProto.BFLOAT16, values.shape,
                                      data.tobytes(), raw=True)  # fmt: skip
    kind = _CHECKPOINT_TYPES.get(like.data_type)
    if kind is not None and np.array_equal(values.astype(kind).astype(np.float32), values):
        return helper.make_tensor(name, like.data_type, values.shape,
                                  values.astype(kind).tobytes(), raw=True)  # fmt: skip
    return helper.make_tensor(name, TensorProto.FLOAT, values.shape, values.tobytes(), raw=True)


def stored_model(model, checkpoint, element):
    """A copy of the ONNX `model` with its matmul weights as MXFP6 holds them (`initializers`),
    or `model` itself when element is None."""
    if element is None:
        return model
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    return initializers(copy, checkpoint, element)


def initializers(model, checkpoint, element):
    """The ONNX `model` (in place, and returned) with each initializer that is a stored matmul
    weight of `checkpoint` replaced by an in-memory one holding its MXFP6 values; element
    None: unchanged."""
    if element is None:
        return model
    graph = model.graph
    for i, t in enumerate(graph.initializer):
        info = checkpoint.tensors.get(t.name)
        if info is None or not stored(t.name, tuple(t.dims)):
            continue
        values = as_stored(checkpoint.read(t.name, mapped=False), element)
        graph.initializer[i].CopyFrom(_tensor(t.name, values, t))
    return model
