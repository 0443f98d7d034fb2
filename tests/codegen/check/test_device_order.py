"""`codegen.check.device_graph.at_first_use`: the device graph's node order, which sets what
onnxruntime holds at once (`PRIORITY_BASED` runs the ready node listed first first)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from codegen.check.device_graph import at_first_use


@st.composite
def graphs(draw):
    """(nodes in a valid order, initializer names, graph input names): each node reads up to
    three values made before it — initializers, graph inputs or earlier nodes' outputs — or
    none (a Constant); node i makes "v{i}"."""
    inits = [f"w{i}" for i in range(draw(st.integers(0, 4)))]
    inputs = [f"x{i}" for i in range(draw(st.integers(1, 3)))]
    nodes, made = [], []
    for i in range(draw(st.integers(1, 24))):
        pool = inits + inputs + made
        reads = draw(st.lists(st.sampled_from(pool), max_size=3)) if pool else []
        nodes.append(helper.make_node("Op", reads, [f"v{i}"], name=f"n{i}"))
        made.append(f"v{i}")
    return nodes, inits, inputs


def _fixed(nodes, inits):
    """Names of the nodes whose value depends on no graph input, by a forward scan."""
    values, out = set(inits), set()
    for n in nodes:
        if all(i in values for i in n.input):
            values.update(n.output)
            out.add(n.name)
    return out


def _needers(nodes, fixed):
    """{fixed node: the graph-input nodes that read it, directly or through fixed nodes}."""
    producer = {o: n for n in nodes for o in n.output}
    found = {}
    for n in nodes:
        if n.name in fixed:
            continue
        stack = list(n.input)
        while stack:
            p = producer.get(stack.pop())
            if p is not None and p.name in fixed and n.name not in found.setdefault(p.name, []):
                found[p.name].append(n.name)
                stack += p.input
    return found


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_weight_chains_run_just_before_their_first_reader(drawn):
    """The order is a permutation of the nodes in which every value is made before it is read;
    the nodes that read a graph input keep their order; a node computed from initializers only
    comes after every graph-input node listed before the first one that needs it, and one
    that nothing of the graph-input part needs (a weight's statistic) comes right after
    what it reads. Fails when the chains stay at the top (identity order), when a chain is
    emitted after its reader, or when a statistic is left to the end."""
    nodes, inits, inputs = drawn
    out = at_first_use(nodes, set(inits))
    assert sorted(n.name for n in out) == sorted(n.name for n in nodes)
    assert len(out) == len(nodes)
    seen = set(inits) | set(inputs)
    for n in out:
        assert all(i in seen for i in n.input), (n.name, [m.name for m in out])
        seen.update(n.output)
    fixed = _fixed(nodes, inits)
    live = [n.name for n in nodes if n.name not in fixed]
    assert [n.name for n in out if n.name not in fixed] == live
    at = {n.name: k for k, n in enumerate(out)}
    needers = _needers(nodes, fixed)
    producer = {o: n.name for n in nodes for o in n.output}
    for name in fixed:
        if name in needers:
            first = min(needers[name], key=at.get)
            between = [m for m in live if at[name] < at[m] < at[first]]
            assert not between, (name, first, between)
            before = [m for m in live if at[m] < at[first]]
            assert all(at[m] < at[name] for m in before), (name, before)
        else:
            node = next(n for n in nodes if n.name == name)
            sources = [at[producer[i]] for i in node.input if i in producer]
            if sources:
                between = [m for m in live if max(sources) < at[m] < at[name]]
                assert not between, (name, between)
            else:  # read from initializers alone: where it was listed
                place = [n.name for n in nodes].index(name)
                listed = {n.name for n in nodes[:place]}
                assert all((at[m] < at[name]) == (m in listed) for m in live), name


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e5, 1e5, width=32), min_size=6, max_size=6),
    st.lists(st.floats(-8e4, 8e4, width=32), min_size=6, max_size=6),
    st.sampled_from([0.5, 3.0]),
    st.booleans(),
)
def test_moves_of_rounded_values_are_neither_rounded_nor_probed(xs, ws, c, keep):
    """`device_graph` leaves a Transpose/Reshape of a rounded value unrounded and unprobed
    (`moves`), and rounds one of a float32 value (a kept result, an initializer): the graph's
    output equals numpy's device model step by step. Graph: y = x·c (kept or not), t = yᵀ,
    u = wᵀ (w an initializer), v = reshape(u), z = t + v. Fails when a kept operand's move is
    left unrounded, or an initializer's."""
    import onnxruntime as ort
    from onnx import TensorProto

    from codegen.check.device_graph import device_graph

    x = np.asarray(xs, np.float32).reshape(2, 3)
    w = np.asarray(ws, np.float32).reshape(3, 2)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "c"], ["y"]),
            helper.make_node("Transpose", ["y"], ["t"], perm=[1, 0]),
            helper.make_node("Transpose", ["w"], ["u"], perm=[1, 0]),
            helper.make_node("Reshape", ["u", "shape"], ["v"]),
            helper.make_node("Add", ["t", "v"], ["z"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [3, 2])],
        initializer=[
            helper.make_tensor("c", TensorProto.FLOAT, [], [c]),
            helper.make_tensor("w", TensorProto.FLOAT, [3, 2], w.ravel().tolist()),
            helper.make_tensor("shape", TensorProto.INT64, [2], [3, 2]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m, names, _ = device_graph(model, "float16", {"y"} if keep else set(), stats=False)
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    (z,) = session.run(["z"], {"x": x})

    def r(a):
        return a.astype(np.float16).astype(np.float32)

    with np.errstate(over="ignore", invalid="ignore"):
        y = r(x) * np.float32(c)
        t = r((y if keep else r(y)).T)
        want = r(t + r(w.T).reshape(3, 2))
    np.testing.assert_array_equal(z, want)
    assert ("t" in names) == keep and "u" in names and "v" not in names


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["bfloat16", "float32", "direct"]), st.booleans())
def test_a_transposed_weight_is_rounded_at_its_source_and_read_by_a_gemm(seed, stored, big):
    """y = x · Wᵀ with W a bfloat16 initializer widened by a Cast (as the exports read a bf16
    checkpoint), a float32 one through an Identity, or one transposed directly; values drawn
    beyond float16's range when `big`. The device graph has no Transpose and reads W by a
    Gemm, and y equals numpy's device model (W rounded, the product in float32 of the
    rounded operands, rounded) within one float16 step; the statistics of W's rounding are
    rounded W's. Fails when the weight is left unrounded."""
    import ml_dtypes
    import onnxruntime as ort
    from onnx import TensorProto

    from codegen.check.device_graph import device_graph, stats_of

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w = (rng.standard_normal((5, 8)) * (3e4 if big else 1.0)).astype(np.float32)
    if stored == "bfloat16":
        w = w.astype(ml_dtypes.bfloat16).astype(np.float32)
        bits = w.astype(ml_dtypes.bfloat16).view(np.uint16)
        init = helper.make_tensor("w", TensorProto.BFLOAT16, [5, 8], bits.tobytes(), raw=True)
        widen = [helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT)]
    else:
        init = helper.make_tensor("w", TensorProto.FLOAT, [5, 8], w.ravel().tolist())
        widen = [helper.make_node("Identity", ["w"], ["wf"])]
    source = "w" if stored == "direct" else "wf"
    widen = [] if stored == "direct" else widen
    graph = helper.make_graph(
        [*widen, helper.make_node("Transpose", [source], ["t"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "t"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5])],
        initializer=[init],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m, names, outputs = device_graph(model, "float16", stats=True)
    ops = [n.op_type for n in m.graph.node]
    assert "Gemm" in ops and "Transpose" not in ops and "MatMul" not in ops
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(["y", *outputs], session.run(["y", *outputs], {"x": x}), strict=True))

    def r(a):
        with np.errstate(over="ignore"):
            return a.astype(np.float16).astype(np.float32)

    with np.errstate(over="ignore", invalid="ignore"):
        want = r(r(x) @ r(w).T)
    finite = np.isfinite(want)
    assert np.array_equal(np.isfinite(got["y"]), finite)
    step = 2.0**-10 * np.abs(want[finite]).max(initial=1.0)
    assert np.abs(got["y"][finite] - want[finite]).max(initial=0.0) <= step
    rounded = "t" if stored == "direct" else "wf"  # the direct weight's rounding is t's
    assert rounded in names
    peak, _, ok = stats_of(got, [rounded])[rounded]
    rw = np.abs(r(w))
    assert ok == np.isfinite(rw).all() and peak == rw[np.isfinite(rw)].max()
