"""`codegen.check.select_reads`: a Where that spreads a small condition over a large tensor
(a score tile's mask) computed by Max/Min in the device graph, against numpy's select of the
same rounded values."""

import numpy as np
import onnxruntime as ort
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from codegen.check.device_graph import device_graph
from codegen.check.select_reads import spread

FILLS = [float("-inf"), float("inf"), 0.0, -3.0, 7e4]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from(FILLS),
    st.booleans(),
    st.sampled_from([(2, 1, 3, 4), (1, 3, 4), (3, 4), (4,)]),
    st.sampled_from(["Constant", "initializer", "input"]),
)
def test_a_spread_where_is_the_select_of_its_rounded_values(seed, fill, swapped, cond, made):
    """y = Where(c, x·k, s) (or Where(c, s, x·k)) on x [2, 5, 3, 4] with ±inf and float16's
    overflow among its values, c of a shape that spreads over it, s a scalar constant (±inf,
    0, finite; beyond float16 too) given as a Constant, an initializer or a graph input: the
    device graph reads no Where at x's size and its y equals numpy's select of the rounded
    operands, rounded. Fails when a bound is taken from the wrong branch, or when s = ±inf
    drops the wrong pass."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 5, 3, 4)) * 2e4).astype(np.float32)
    x.ravel()[rng.integers(0, x.size, 4)] = [np.inf, -np.inf, 0.0, -0.0]
    c = rng.random(cond) < 0.5
    k = np.float32(1.5)
    value = helper.make_tensor("s", TensorProto.FLOAT, [], [fill])
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape)),
              helper.make_tensor_value_info("c", TensorProto.BOOL, list(cond))]  # fmt: skip
    nodes = [helper.make_node("Mul", ["x", "k"], ["xk"])]
    inits = [helper.make_tensor("k", TensorProto.FLOAT, [], [float(k)])]
    if made == "Constant":
        nodes.append(helper.make_node("Constant", [], ["s"], value=value))
    elif made == "initializer":
        inits.append(value)
    else:
        inputs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, []))
    branches = ["s", "xk"] if swapped else ["xk", "s"]
    nodes.append(helper.make_node("Where", ["c", *branches], ["y"]))
    graph = helper.make_graph(nodes, "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m, _, _ = device_graph(model, "float16", stats=False)
    wheres = [n for n in m.graph.node if n.op_type == "Where"]
    assert all("select_" in n.output[0] for n in wheres), [n.output for n in wheres]
    feed = {"x": x, "c": c, **({"s": np.array(fill, np.float32)} if made == "input" else {})}
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(["y"], feed)

    def r(a):
        with np.errstate(over="ignore"):
            return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)

    with np.errstate(over="ignore", invalid="ignore"):
        xk = r(r(x) * k)
        s = r(np.float32(fill))
        want = r(np.where(c, s, xk) if swapped else np.where(c, xk, s))
    np.testing.assert_array_equal(y, want)


def test_spread_reads_known_shapes_only():
    """A condition spreads over a tensor when it is as large at each dim or 1 there, and 1 at
    a known dim > 1; the same size, a larger condition or unknown dims are left to Where."""
    assert spread(("q", "k"), (1, 16, 1, "q", "k"))
    assert spread((1, 1, "q", "k"), (1, 8, "q", "k"))
    assert not spread((1, 16, 1, "q", 1), (1, 16, 1, "q", 1))  # a row guard: the same size
    assert not spread(("q", "k"), (1, 1, "q", "k"))  # nothing larger by a known size
    assert not spread(("q", "k"), (16, "q", "p"))
    assert not spread((16, "q", "k"), ("q", "k"))
    assert not spread(("q", None), (16, "q", "k")) and not spread(None, (16, 2))


def test_scalars_reads_constants_held_in_the_model_only():
    """A one-element initializer whose bytes are a checkpoint's (external data, here a file
    that is not there) is not read; Constant nodes and inline initializers are."""
    from onnx import external_data_helper

    from codegen.check.select_reads import scalars

    outside = helper.make_tensor("w", TensorProto.FLOAT, [1], np.float32([2]).tobytes(), raw=True)
    external_data_helper.set_external_data(outside, "absent.safetensors", offset=0, length=4)
    outside.ClearField("raw_data")
    outside.data_location = TensorProto.EXTERNAL
    inside = helper.make_tensor("k", TensorProto.FLOAT, [], [0.5])
    value = helper.make_tensor("v", TensorProto.FLOAT, [], [-np.inf])
    fill = helper.make_node("Constant", [], ["s"], value=value)
    graph = helper.make_graph([fill], "g", [], [], initializer=[outside, inside])
    assert scalars(helper.make_model(graph)) == {"k": 0.5, "s": -np.inf}
