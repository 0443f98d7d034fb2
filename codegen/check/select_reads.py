"""How `device_graph` computes a Where that spreads a small condition over a large tensor: an
attention score tile masked by its [q, k] mask, the tile [1, heads, 1, q, k]. onnxruntime's
Where selects x where the condition holds, selects s where it does not, and merges the two:
three passes over the tile, on one thread, through two temporaries of its size (an E4B
vision layer at 10,080 patches: 9.7 s of Where in its 25.7 s of onnxruntime).

Where(c, x, s), s a scalar, is min(max(x, lo), hi) with lo = Where(c, −inf, s) and
hi = Where(c, +inf, s) made at the condition's size (Where(c, s, x): the branches swapped): two
elementwise passes that onnxruntime runs on its threads. max(x, −inf) = min(x, +inf) = x and
min(max(x, s), s) = s for every x but NaN, so the values are the Where's wherever x is not
NaN (a zero may come out as −0.0); a NaN in x is the device graph's first non-finite tensor
at x or before it (x is probed, or moves a probed tensor), which the search and the report
read before anything the select makes. s = −inf needs only min(x, hi), s = +inf only
max(x, lo): one pass.
"""

import math

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def shapes(inferred):
    """{value: (ONNX element type, shape: a tuple of ints, dim names and None for unknown)}
    of an inferred model's values whose rank is known."""
    out = {}
    for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
        t = v.type.tensor_type
        if t.HasField("shape"):
            dims = tuple(d.dim_param or (d.dim_value if d.HasField("dim_value") else None)
                         for d in t.shape.dim)  # fmt: skip
            out[v.name] = (t.elem_type, dims)
    for t in inferred.graph.initializer:
        out[t.name] = (t.data_type, tuple(t.dims))
    return out


def scalars(model):
    """{value: float} of the model's one-element float constants (Constant nodes and
    initializers held in the model: one in a checkpoint's bytes is not read)."""
    out = {}
    for t in model.graph.initializer:
        inline = t.data_location != TensorProto.EXTERNAL
        if inline and t.data_type == TensorProto.FLOAT and math.prod(t.dims) == 1:
            out[t.name] = float(numpy_helper.to_array(t).ravel()[0])
    for n in model.graph.node:
        value = next((a.t for a in n.attribute if a.name == "value"), None)
        if n.op_type == "Constant" and value is not None and value.data_type == TensorProto.FLOAT:
            if math.prod(value.dims) == 1:
                out[n.output[0]] = float(numpy_helper.to_array(value).ravel()[0])
    return out


def spread(cond, big):
    """True when a condition of shape `cond` spreads over a tensor of shape `big`, read at
    least twice: aligned from the right, each of its dims is big's or 1, and big is a known
    size > 1 at one of its 1s. An unknown dim: False."""
    if cond is None or big is None or len(cond) > len(big) or None in cond or None in big:
        return False
    cond = (1,) * (len(big) - len(cond)) + tuple(cond)
    if any(c not in (b, 1) for c, b in zip(cond, big, strict=True)):
        return False
    return any(c == 1 and isinstance(b, int) and b > 1 for c, b in zip(cond, big, strict=True))


def _scalar(shape):
    return shape is not None and all(d == 1 for d in shape)


def fast_selects(nodes, shape, constant):
    """(`nodes` with each float Where(c, x, s) or Where(c, s, x) whose s is a one-element
    value and whose condition `spread`s over x made of Max/Min as the module says, its result
    keeping its name; the initializers they read). shape: {value: (element type, shape)}
    (`shapes`), read at a value's name less a "/exact" suffix (`device_graph`'s name for a
    graph input's rounding); constant: {value: float} (`scalars`, a rounded constant keeps
    ±inf)."""
    out, extra = [], []
    for node in nodes:
        made = _select(node, shape, constant) if node.op_type == "Where" else None
        if made is None:
            out.append(node)
            continue
        out += made[0]
        extra += made[1]
    return out, extra


def _select(node, shape, constant):
    """(nodes replacing Where `node`, initializers they read) or None (see `fast_selects`)."""
    c, a, b = node.input

    def of(name):
        return shape.get(name.removesuffix("/exact"), (None, None))

    def fits(x, s):
        (xt, xs), (st, ss) = of(x), of(s)
        return xt == st == TensorProto.FLOAT and _scalar(ss) and spread(of(c)[1], xs)

    found = [(x, s, swapped) for x, s, swapped in ((a, b, False), (b, a, True)) if fits(x, s)]
    if not found:
        return None
    x, s, swapped = found[0]
    y = node.output[0]
    inf = {}

    def bound(sign):
        name = f"{y}/select_{'hi' if sign > 0 else 'lo'}"
        inf[sign] = helper.make_tensor(f"{y}/select_inf{sign:+d}", TensorProto.FLOAT, [],
                                       [sign * np.inf])  # fmt: skip
        ins = [c, s, inf[sign].name] if swapped else [c, inf[sign].name, s]
        return name, helper.make_node("Where", ins, [name], name=name)

    value = constant.get(s.removesuffix("/exact"))
    nodes = []
    if value != -np.inf:  # max(x, lo): s where the select takes s
        lo, made = bound(-1)
        low = y if value == np.inf else f"{y}/select_max"
        nodes += [made, helper.make_node("Max", [x, lo], [low], name=low)]
        x = low
    if value != np.inf:
        hi, made = bound(+1)
        nodes += [made, helper.make_node("Min", [x, hi], [y], name=f"{y}/select_min")]
    return nodes, list(inf.values())
