"""How `device_graph` reads a matmul weight. The exported graph reads each weight [out, in] (an
initializer) through a Transpose, whose result the device stores in the compute format: its
Cast pair rounded a transposed float32 copy, and the MatMul read a second one (a 31B prefill
layer: 0.6 s of Transpose and 1 s of Cast in onnxruntime, of 2.9 s). Rounding commutes with a
transpose, so the weight is rounded where it is read from the checkpoint (`T/source`, the
statistics of the Transpose result T taken there: the same values), and a MatMul of a 2-D
weight transposed by [1, 0] becomes a Gemm that reads it with transB (`gemm_reads`), the
Transpose gone."""

from onnx import TensorProto, helper


def weight_transposes(model, made, keep):
    """{T: W}: the Transpose results T among `made` (probed node results), not kept in float32
    by a plan, whose operand W is a float32 initializer."""
    floats = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT}
    rounded = set(made) - set(keep)
    return {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Transpose" and n.input[0] in floats and n.output[0] in rounded
    }


def source(name):
    """The rounded weight a Transpose result `name` is made from and probed at."""
    return f"{name}/source"


def rounded_weight(name, weight, to):
    """The Cast pair that rounds `weight` to ONNX type `to` into `source(name)`."""
    return [
        helper.make_node("Cast", [weight], [f"{name}/low"], to=to, name=f"{name}/to_low"),
        helper.make_node("Cast", [f"{name}/low"], [source(name)], to=TensorProto.FLOAT,
                         name=f"{name}/to_float"),
    ]  # fmt: skip


def gemm_reads(nodes, outputs):
    """`nodes` with each MatMul(A, T) — T a Transpose by [1, 0] of a 2-D S, unrounded (a move
    of a rounded value, or a weight rounded at its source), read by MatMuls alone as their
    second operand, no graph output — as Gemm(A flattened to rows, S, transB) reshaped to
    A's leading dimensions and S's rows; those Transposes dropped: the same float32
    products, S read in place. outputs: the graph's output names."""
    readers, made_by = _index(nodes)
    folded = {
        t: n.input[0] for t, n in made_by.items()
        if n.op_type == "Transpose" and _perm(n) == [1, 0] and t not in outputs
        and all(r.op_type == "MatMul" and list(r.input[1:]) == [t] for r in readers.get(t, []))
    }  # fmt: skip
    out = []
    for node in nodes:
        if node.op_type == "Transpose" and node.output[0] in folded:
            continue
        if node.op_type == "MatMul" and node.input[1] in folded:
            out += _gemm(node, folded[node.input[1]])
        else:
            out.append(node)
    return out


# (initializer type, compute format) a Cast converts directly as through float32
_DIRECT = frozenset({(TensorProto.BFLOAT16, TensorProto.FLOAT16),
                     (TensorProto.BFLOAT16, TensorProto.BFLOAT16),
                     (TensorProto.FLOAT16, TensorProto.FLOAT16)})  # fmt: skip


def narrowed_casts(nodes, initializers, to):
    """`nodes` with each weight's widening Cast (a bfloat16 or float16 initializer to
    float32) and the rounding Cast that alone reads it (to `to`) made one Cast from the
    initializer: the same values (measured in onnxruntime on every bfloat16 and float16 bit
    pattern) without the float32 copy. initializers: {name: ONNX element type}."""
    readers, made_by = _index(nodes)
    widened = {}
    for node in nodes:
        source = made_by.get(node.input[0]) if node.op_type == "Cast" and node.input else None
        if source is None or source.op_type != "Cast" or _to(node) != to:
            continue
        origin = initializers.get(source.input[0])
        if (origin, to) in _DIRECT and readers[node.input[0]] == [node]:
            widened[id(source)] = source
            node.input[0] = source.input[0]
    return [n for n in nodes if id(n) not in widened]


def _index(nodes):
    """({value: the nodes reading it, in order}, {value: the node making it}) of `nodes`."""
    readers, made_by = {}, {}
    for node in nodes:
        for i in node.input:
            readers.setdefault(i, []).append(node)
        made_by.update({o: node for o in node.output})
    return readers, made_by


def _to(node):
    return next(a.i for a in node.attribute if a.name == "to")


def _perm(node):
    return next((list(a.ints) for a in node.attribute if a.name == "perm"), None)


def _gemm(matmul, s):
    """MatMul(A, T) → y, T = Sᵀ, as Gemm(A as [-1, in], S, transB) reshaped to A's leading
    dimensions and S's rows."""
    a, _ = matmul.input
    y = matmul.output[0]
    return [
        helper.make_node("Shape", [a], [f"{y}/lead"], end=-1, name=f"{y}/lead"),
        helper.make_node("Shape", [s], [f"{y}/n"], end=1, name=f"{y}/n"),
        helper.make_node("Concat", [f"{y}/lead", f"{y}/n"], [f"{y}/shape"], axis=0,
                         name=f"{y}/shape"),
        helper.make_node("Flatten", [a], [f"{y}/rows"], axis=-1, name=f"{y}/rows"),
        helper.make_node("Gemm", [f"{y}/rows", s], [f"{y}/gemm"], transB=1, name=f"{y}/gemm"),
        helper.make_node("Reshape", [f"{y}/gemm", f"{y}/shape"], [y], name=matmul.name),
    ]  # fmt: skip
