"""`export --clip-fp16`: keep an exported graph inside float16's range where it is known to
leave it (off by default; what it did is recorded in the manifest).

QEfficient's `FP16ClipTransform` clips float32 initializers to ±65504 at export. Our weights
stay in the checkpoint's bytes, so instead a `Clip` follows the cast of each weight whose
values leave the range (read once to find them). And the known overflow points get a `Clip`
on their results: Gemma 4's vision standardize step, `(h − std_bias) · std_scale`, whose
`h = pooled · sqrt(hidden)` and `h − std_bias` overflow float16 in the 26B/31B towers (vLLM
issue #40290, transformers PR #46277). A clamp turns an inf into ±65504, a wrong but finite
value: `verify --precision float16` then shows the error it leaves, not a NaN.
"""

import numpy as np
from onnx import TensorProto, helper

FP16_MAX = 65504.0
# weights at known overflow points: the nodes that read them, and their other operands, are clamped
KNOWN_OVERFLOW_WEIGHTS = ("std_bias", "std_scale")
_BOUNDS = ("clip_fp16/min", "clip_fp16/max")


def _clamp(graph, tensor):
    """Clamp `tensor` to ±65504 where it is made: its producer writes `tensor/raw` and a
    `Clip` writes `tensor` (a weight without a producer: its readers read the Clip)."""
    producer = next((n for n in graph.node if tensor in n.output), None)
    if producer is None:
        source, out = tensor, f"{tensor}/clip_fp16"
        for node in graph.node:
            node.input[:] = [out if i == tensor else i for i in node.input]
    else:
        source, out = f"{tensor}/raw", tensor
        producer.output[:] = [source if o == tensor else o for o in producer.output]
    graph.node.append(helper.make_node("Clip", [source, *_BOUNDS], [out], name=f"{out}/clip"))


def _weight_tensor(graph, name):
    """The tensor a weight enters the graph's math as: its `Cast` output, or itself."""
    cast = next((n for n in graph.node if n.op_type == "Cast" and n.input[0] == name), None)
    return name if cast is None else cast.output[0]


_ARITHMETIC = ("Add", "Sub", "Mul", "Div")
_RESHAPES = ("Reshape", "Expand", "Unsqueeze", "Squeeze", "Identity", "Cast")


def _carriers(graph, tensor):
    """tensor and every tensor that is only a reshape (or cast) of it."""
    carried, grew = {tensor}, True
    while grew:
        more = {
            o for n in graph.node if n.op_type in _RESHAPES and n.input[0] in carried
            for o in n.output
        }  # fmt: skip
        grew = not more <= carried
        carried |= more
    return carried


def clip_fp16(model, weights, read):
    """Clamp the out-of-range weights and the known overflow points of `model` (in place).

    weights: the graph's checkpoint tensor names; read(name) → its values. → {"weights":
    [names clipped], "tensors": [results clamped]} (both empty: nothing touched).
    """
    graph = model.graph
    clipped = [n for n in weights if np.max(np.abs(read(n).astype(np.float32))) > FP16_MAX]
    known = [n for n in weights if n.rsplit(".", 1)[-1] in KNOWN_OVERFLOW_WEIGHTS]
    points = []
    for name in known:
        carried = _carriers(graph, _weight_tensor(graph, name))
        for node in graph.node:
            if node.op_type in _ARITHMETIC and carried & set(node.input):
                points += [t for t in [*node.input, *node.output] if t not in carried | {*points}]
    targets = [_weight_tensor(graph, n) for n in clipped] + points
    if not targets:
        return {"weights": [], "tensors": []}
    for name, value in zip(_BOUNDS, (-FP16_MAX, FP16_MAX), strict=True):
        graph.node.insert(0, helper.make_node("Constant", [], [name], name=name,
                                              value=helper.make_tensor(name, TensorProto.FLOAT,
                                                                       [], [value])))  # fmt: skip
    for t in targets:
        _clamp(graph, t)
    _toposort(graph)
    return {"weights": clipped, "tensors": points}


def _toposort(graph):
    """Reorder the nodes so each follows the producers of its inputs (the Clips were appended)."""
    made = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in made for i in n.input)]
        if not ready:
            raise ValueError("clip_fp16: the graph has a cycle or an input nothing makes")
        for n in ready:
            ordered.append(n)
            made.update(n.output)
        pending = [n for n in pending if all(n is not r for r in ready)]
    del graph.node[:]
    graph.node.extend(ordered)
