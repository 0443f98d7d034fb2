"""Device numerics (`ref.numerics`, `codegen.check.precision`): MXINT8 against a direct reading of
the OCP MX v1.0 spec, the per-operation float16 model against float32, and `verify --precision`
catching a checkpoint that overflows float16 in the vision standardize step."""

import math
from fractions import Fraction
from functools import partial, reduce

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ref import mxint8, numerics
from tests.util import examples

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).smallest_subnormal)


def spec_block(values):
    """OCP MX v1.0 §6.3 for one MXINT8 block, in exact rational arithmetic: (E8M0 bits,
    [int8 element]). values: up to 32 finite floats."""
    amax = max(Fraction(abs(v)) for v in values)
    if amax == 0:
        shared = -127
    else:
        shared = 0  # the largest e with 2^e <= amax
        while Fraction(2) ** shared > amax:
            shared -= 1
        while Fraction(2) ** (shared + 1) <= amax:
            shared += 1
        shared = min(max(shared, -127), 127)
    step = Fraction(2) ** (shared - 6)  # INT8 elements carry 2^-6
    elements = [max(-127, min(127, round(Fraction(v) / step))) for v in values]  # ties to even
    return shared + 127, elements


def spec_value(bits, element):
    """The element's value; float32 subnormals read as 0 (XLA:CPU flushes them)."""
    value = Fraction(element) * Fraction(2) ** (bits - 127 - 6)
    return float(value) if abs(value) >= Fraction(2) ** -126 else 0.0


magnitudes = st.sampled_from(
    [F32_TINY, 2.0**-133, 2.0**-100, 2.0**-10, 0.5, 1.0, 1.984375, 3.0, 2.0**17]
)
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
special = st.sampled_from([0.0, -0.0, F32_TINY, -F32_TINY, F32_MAX, -F32_MAX, 65504.0, -65504.0])
element = st.one_of(finite32, special, magnitudes.flatmap(lambda m: st.floats(-m, m, width=32)))


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(element, min_size=1, max_size=70))
@example([1.0, 2.0**-7, 3 * 2.0**-7, -(2.0**-7), 5 * 2.0**-7, F32_TINY])  # ties: 0.5, 1.5, 2.5
def test_mxint8_matches_the_spec_block_by_block(values):
    x = np.asarray(values, np.float32)
    scales, elements = (np.asarray(a) for a in mxint8.mxint8_encode(x))
    decoded = np.asarray(mxint8.mxint8_round_trip(jnp.asarray(x)))
    for b in range(-(-len(x) // 32)):
        block = [float(v) for v in x[32 * b : 32 * b + 32]]
        bits, want = spec_block(block)
        assert scales[b] == bits
        assert elements[b, : len(block)].tolist() == want
        assert not elements[b, len(block) :].any()
        got = decoded[32 * b : 32 * b + len(block)]
        assert [abs(v) for v in got.tolist()] == [abs(spec_value(bits, e)) for e in want]
        assert all(v * e >= 0 for v, e in zip(got.tolist(), want, strict=True))
    # stored once, stored again: the same (a quantized cache is rewritten every step)
    again = np.asarray(mxint8.mxint8_round_trip(jnp.asarray(decoded)))
    assert np.array_equal(again, decoded)


@settings(max_examples=examples(20), deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=32, max_size=32))
@example([9.68e-41] + [0.0] * 31)  # an all-subnormal block: decodes to 0 (a draw found it)
def test_mxint8_error_is_at_most_half_a_step_below_the_clamp(values):
    x = np.asarray(values, np.float32)
    amax = float(np.max(np.abs(x)))
    got = np.asarray(mxint8.mxint8_round_trip(jnp.asarray(x)), np.float64)
    if amax == 0:
        assert not got.any()
        return
    step = 2.0 ** (math.floor(math.log2(amax)) - 6)
    unclamped = np.abs(x) <= 127 * step
    near = np.abs(got - x) <= step / 2
    # a decoded value below float32's normal range reads as 0 (XLA:CPU flushes subnormals)
    flushed = (got == 0) & (np.abs(x) < 2.0**-126 + step / 2)
    assert np.all((near | flushed)[unclamped])
    assert np.all(np.abs(got) <= 127 * step)


def test_mxint8_refuses_nan_and_inf_by_index():
    x = np.zeros((2, 40), np.float32)
    x[1, 33] = np.nan
    with pytest.raises(ValueError, match=r"x\[1, 33\] = nan: expected finite"):
        mxint8.mxint8_encode(x)
    x[1, 33] = -np.inf
    with pytest.raises(ValueError, match=r"x\[1, 33\] = -inf"):
        mxint8.mxint8_encode(x)
    # traced (a cache write under jit): the block holding the NaN decodes to NaN, others stay
    x[1, 33], x[0, 3] = np.nan, 1.5
    out = np.asarray(jax.jit(mxint8.mxint8_round_trip)(jnp.asarray(x)))
    assert np.isnan(out[1, 32:]).all() and not np.isnan(out[1, :32]).any()
    assert out[0, 3] == 1.5


def test_formats_are_named_and_bad_names_refused():
    assert numerics.format_name("fp16") == "float16"
    assert numerics.finite_max("bf16") == float(jnp.finfo(jnp.bfloat16).max)
    with pytest.raises(ValueError, match=r"format 'int4': expected one of float32, float16"):
        numerics.format_name("int4")
    with pytest.raises(ValueError, match="mxint8"):
        numerics.store(jnp.ones(3), "fp8")
    x = jnp.asarray([65519.0, 65520.0, 1e-8, 3e-8], jnp.float32)
    assert np.asarray(numerics.round_to(x, "float16")).tolist() == [65504.0, np.inf, 0.0, 2**-24]


def test_emulate_rounds_every_operation_and_probe_names_the_first_overflow():
    def fn(x):
        return (x * 1000.0) * 1000.0 / 1000.0 / 1000.0  # 1e6 overflows float16 midway

    x = jnp.ones(3, jnp.float32)
    assert np.array_equal(numerics.emulate(fn, "float32")(x), fn(x))
    assert np.isinf(np.asarray(jax.jit(numerics.emulate(fn, "float16"))(x))).all()
    assert np.isfinite(np.asarray(numerics.emulate(fn, "bfloat16")(x))).all()
    out, records = numerics.probe(fn, "fp16", x)
    first = next(r for r in records if r.nonfinite)
    assert (first.primitive, first.shape, first.max_abs) == ("mul", (3,), 0.0)
    assert records[0].max_abs == 1000.0 and not records[0].nonfinite
    # the division reads an inf: it is not where the overflow happened
    assert [r.nonfinite for r in records] == [False, True, False, False]


class _Standardize(nn.Module):
    """(h − bias)·scale inside a module, then a residual add: the overflow of the 26B/31B
    vision standardize step, with two subtractions of the same module to number."""

    @nn.compact
    def __call__(self, h, bias, scale):
        return (h - bias) * scale + (h - 1.0)


@settings(max_examples=examples(20), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_emulate_keeps_the_planned_tensors_in_float32(seed, width):
    """`emulate(fn, fp16, keep=...)` keeps in float32 exactly the tensors named by the
    probe's `Record.key`s: keeping the overflowing subtraction (its key from the probe) gives
    numpy's float32 subtraction of the rounded operands, rounded after the multiply; keeping
    every tensor gives fn in float32 on the rounded inputs; a key naming no tensor changes
    nothing. Oracle: numpy, step by step."""
    rng = np.random.default_rng(seed)
    h = rng.uniform(1e4, 3e4, (2, width)).astype(np.float32)
    bias = np.full(width, -60000.0, np.float32)
    scale = np.full(width, 1e-4, np.float32)
    module = _Standardize()
    fn = partial(module.apply, {})
    _, records = numerics.probe(fn, "fp16", h, bias, scale)
    first = next(r for r in records if r.nonfinite)
    assert first.key == "_Standardize:sub#0" and first.name == "_Standardize"

    def f16(a):
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)

    hr, br, sr = f16(h), f16(bias), f16(scale)
    want = f16(f16((hr - br) * sr) + f16(hr - 1.0))
    got = numerics.emulate(fn, "fp16", keep={first.key})(h, bias, scale)
    assert np.array_equal(np.asarray(got), want)
    everything = {r.key for r in records}
    got = numerics.emulate(fn, "fp16", keep=everything)(h, bias, scale)
    assert np.array_equal(np.asarray(got), (hr - br) * sr + (hr - 1.0))
    plain = numerics.emulate(fn, "fp16")(h, bias, scale)
    other = numerics.emulate(fn, "fp16", keep={"_Standardize:sub#2"})(h, bias, scale)
    assert np.array_equal(np.asarray(other), np.asarray(plain)) and np.isinf(plain).all()


# each example exports a graph (jax2onnx): a few drawn, and both widths pinned
@settings(max_examples=examples(3), deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([512, 1536]))
@example(0, 512)
@example(1, 1536)
def test_a_mean_is_one_device_operation_as_in_the_graph(seed, width):
    """An RMSNorm whose rows' sums of squares pass float16's 65,504 while their means do not
    (|x| in [60, 250]): the graph computes the mean as one ReduceMean, so the ONNX device model
    (`codegen.check.device_graph.device_graph`, a Cast pair after every tensor, run in onnxruntime)
    stays finite, and `ref`'s device model must too, agreeing to two float16 steps (the graph
    takes rsqrt as Sqrt then Div: one rounding more). Before, `ref` rounded the sum and turned
    non-finite at `reduce_sum` (the E2B prefill audit's `layers.12.input_layernorm`). A sum
    read by anything but its mean's division stays a tensor, rounded and recorded."""
    import onnxruntime as ort
    from jax2onnx import to_onnx

    from codegen.check.device_graph import device_graph
    from ref.layers import rms_norm

    rng = np.random.default_rng(seed)
    x = (rng.uniform(60, 250, (3, width)) * rng.choice([-1, 1], (3, width))).astype(np.float32)
    w = rng.uniform(0.5, 2, width).astype(np.float32)
    fn = partial(rms_norm, eps=1e-6)
    got, records = numerics.probe(fn, "fp16", x, w)
    assert not any(r.nonfinite for r in records), [r for r in records if r.nonfinite]
    assert "reduce_sum" not in {r.primitive for r in records}
    spec = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, w)]
    model, _, _ = device_graph(to_onnx(fn, spec), "float16")
    session = ort.InferenceSession(model.SerializeToString())
    names = [i.name for i in session.get_inputs()]
    (want,) = session.run([session.get_outputs()[0].name], dict(zip(names, (x, w), strict=True)))
    assert np.isfinite(want).all()
    assert np.abs(np.asarray(got) - want).max() <= 2 * 2.0**-10 * np.abs(want).max()

    def kept(x):  # the sum also read elsewhere: no mean
        total = jnp.sum(x * x, axis=-1, keepdims=True)
        return total / width + total

    _, records = numerics.probe(kept, "fp16", x)
    assert any(r.primitive == "reduce_sum" and r.nonfinite for r in records)


stat_values = st.sampled_from([0.0, -0.0, 1.5, -3.0, 6e4, -6e4, 7e4, np.inf, -np.inf, np.nan])


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(stat_values | st.floats(-1e5, 1e5, width=32), max_size=40),
    st.booleans(),
    st.booleans(),
)
def test_fast_statistics_give_the_full_answer_or_name_what_they_cannot(values, keep, full_z):
    """`device_graph`'s full statistics (largest finite |x|, any NaN, all finite) are numpy's
    reading of each tensor, and its "fast" ones (max, min and sum, read in place) give the
    same for every probed tensor that is finite;
    `stats_of` raises `Inexact` naming each tensor that is not (a NaN among finite values
    included, which onnxruntime's ReduceMax skips) unless it was given full statistics.
    Graph: y = x·2, z = y − x; y kept float32 or not; z with full statistics or not."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from codegen.check.device_graph import Inexact, device_graph, stats_of

    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Sub", ["y", "x"], ["z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [len(values)])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [len(values)])],
        initializer=[helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    feed = {"x": np.asarray(values, np.float32)}
    kept, full_set = {"y"} if keep else set(), {"z"} if full_z else set()
    got = {}
    for stats in ("fast", True):
        m, names, outputs = device_graph(model, "float16", kept, stats, full=full_set)
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        got[stats] = dict(zip(outputs, session.run(outputs, feed), strict=True))
    with np.errstate(all="ignore"):
        x16 = feed["x"].astype(np.float16).astype(np.float32)
        y = x16 * 2 if keep else (x16 * 2).astype(np.float16).astype(np.float32)
        tensors = {"y": y, "z": (y - x16).astype(np.float16).astype(np.float32)}
    full = stats_of(got[True], names)
    for n, t in tensors.items():  # numpy's own reading of each tensor
        finite = np.abs(t[np.isfinite(t)])
        want = (float(finite.max()) if finite.size else 0.0, bool(np.isnan(t).any()),
                bool(np.isfinite(t).all()))  # fmt: skip
        assert full[n] == want, (n, t)
    unsure = [n for n in names if not full[n][2] and n not in full_set]
    if not unsure:
        assert stats_of(got["fast"], names) == full
    else:
        with pytest.raises(Inexact) as raised:
            stats_of(got["fast"], names)
        assert raised.value.names == unsure


@pytest.fixture(scope="module")
def default_model():
    from codegen.export.defaults import default_checkpoint
    from ref.gemma4.model import Gemma4

    return Gemma4.from_pretrained(default_checkpoint())


# Bounds on benign models (the default tiny Gemma 4): relative to max |float32|; measured
# float16 ~1e-3 (vision) and ~2e-3–7e-3 (logits); bfloat16 has 3 fewer mantissa bits (8×).
FP16_BOUND, BF16_BOUND = 2e-2, 1.5e-1


@pytest.fixture(scope="module")
def float32_run(default_model):
    """The float32 device model and `ref` itself on one random prompt, run once for both
    formats below (they do not depend on the format): (prompt, the device model's soft tokens,
    its per-step logits, its tokens, ref's tokens)."""
    from codegen.check.drift import DeviceGemma4, random_prompt

    ids, patches, grids = random_prompt(default_model, np.random.default_rng(0))
    exact = DeviceGemma4(default_model, "float32", "float32")
    embeds = exact.vision.embed(patches, grids)[0]
    tokens = exact.generate(ids[None], patches, grids, max_new_tokens=3)[0]
    plain = default_model.generate(ids[None], patches, grids, max_new_tokens=3)[0]
    return (ids, patches, grids), embeds, exact.logits, tokens, plain


@pytest.mark.parametrize(("precision", "bound"), [("float16", FP16_BOUND), ("bf16", BF16_BOUND)])
def test_device_precision_stays_near_float32_on_the_default_model(
    default_model, float32_run, precision, bound
):
    from codegen.check.drift import DeviceGemma4

    (ids, patches, grids), want, logits, tokens, plain = float32_run
    device = DeviceGemma4(default_model, precision, "mxint8")
    got = device.vision.embed(patches, grids)[0]
    assert np.max(np.abs(got - want)) <= bound * np.max(np.abs(want))
    device.generate(ids[None], patches, grids, max_new_tokens=3)
    assert len(logits) == len(device.logits) == 3
    for a, b in zip(logits[:1], device.logits[:1], strict=True):
        assert np.max(np.abs(b - a)) <= bound * np.max(np.abs(a))
    # float32 compute with a float32 cache is ref itself
    assert plain.tolist() == tokens.tolist()


def test_drift_command_reports_each_prompt(capsys):
    """`python -m codegen drift` on the default model (matmul weights as MXFP6): a row per
    prompt and the agreement over every generated token (2 prompts × 3 tokens)."""
    from codegen.__main__ import main
    from codegen.export.defaults import default_checkpoint

    argv = ["drift", "--model", str(default_checkpoint()), "--prompts", "2", "--mxfp6"]
    assert main([*argv, "--max-new-tokens", "3", "--kv-dtype", "mxint8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "float32 vs float16 compute, KV cache mxint8, MXFP6 (e2m3) matmul weights"
    assert [line.split()[0] for line in out[2:4]] == ["0", "1"], out
    assert out[-1].startswith("agreement ") and "/6 = " in out[-1], out


def _tower(folder, overflowing=True):
    """The default tower saved alone; overflowing: built to overflow float16 in the
    standardize step only: std_bias −65280 (fits float16 and bfloat16), the last layer's
    output scaled ×100 so that h = pooled·sqrt(32) > 240 somewhere and h − std_bias > 65504;
    std_scale 1e-4 brings the float32 result back to ~6."""
    import ml_dtypes

    from codegen.export.defaults import DEFAULT_CONFIG, default_tensors
    from weights import save_checkpoint

    prefix = "model.vision_tower."
    t = {n[len(prefix) :]: a for n, a in default_tensors().items() if n.startswith(prefix)}
    if not overflowing:
        save_checkpoint(folder, dict(DEFAULT_CONFIG["vision_config"]), t)
        return folder
    t["std_bias"] = np.full_like(t["std_bias"], -65280.0)
    t["std_scale"] = np.full_like(t["std_scale"], 1e-4)
    w = "encoder.layers.2.post_feedforward_layernorm.weight"
    t[w] = (t[w].astype(np.float32) * 100).astype(ml_dtypes.bfloat16)
    save_checkpoint(folder, dict(DEFAULT_CONFIG["vision_config"]), t)
    return folder


def test_verify_precision_names_the_standardize_overflow_and_clip_clamps_it(tmp_path, capsys):
    """A tower whose standardize step (h − std_bias) passes 65504: fine in float32; in float16
    both device models name the Sub, whole and layer by layer; exported with --clip-fp16 the
    graph clamps it and the check passes. (bfloat16's range: the default model's test.)"""
    import json

    from codegen.__main__ import main
    from codegen.export.command import ExportOptions, export

    model = _tower(tmp_path / "ckpt")
    for out, clip in ((tmp_path / "plain", False), (tmp_path / "clipped", True)):
        export(ExportOptions(out=out, model=model, budgets=(70,), verify=False, clip_fp16=clip))
    assert main(["verify", str(tmp_path / "plain")]) == 0  # float32 is fine
    capsys.readouterr()
    entry = json.loads((tmp_path / "clipped" / "manifest.json").read_text())["graphs"][0]
    assert entry["clip_fp16"]["weights"] == [] and "sub_out_1" in entry["clip_fp16"]["tensors"]
    # the whole graph (the tiny tower's default) and layer by layer (a released tower's)
    for way in ([], ["--layerwise"]):
        plain = ["verify", str(tmp_path / "plain"), *way]
        assert main([*plain, "--precision", "fp16"]) == 1
        text = capsys.readouterr().out
        assert "ref: sub [70, 32] in VisionModel turns non-finite" in text
        assert "onnx: tensor 'sub_out_1' (Sub of " in text
        assert main(["verify", str(tmp_path / "clipped"), *way, "--precision", "fp16"]) == 0
        assert "(clamped in the graph by --clip-fp16)" in capsys.readouterr().out


def _pooled_errors(text):
    """(ref's, the graph's) relative error of the tower's `pooled` in a --precision table."""
    row = next(line.split() for line in text.splitlines() if line.startswith("vision ")
               and line.split()[2] == "pooled")  # fmt: skip
    return float(row[3]), float(row[4])


def _bfloat16_values(t):
    """An in-memory bfloat16 or float32 initializer's values as float32."""
    from onnx import TensorProto

    if t.data_type == TensorProto.BFLOAT16:
        bits = np.frombuffer(t.raw_data, np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(tuple(t.dims))
    return np.frombuffer(t.raw_data, np.float32).reshape(tuple(t.dims))


def test_verify_precision_mxfp6_stores_the_graphs_matmul_weights(tmp_path, capsys):
    """`verify --precision fp16 --mxfp6 e3m2`: the graph's linear weights are the independent
    encoder's MXFP6 (ml_dtypes' float6, blocks of 32 along each row), every other
    initializer (norms, clip bounds, the position table) the checkpoint's bytes; `ref` and the
    graph hold the same rounded weights: their errors to float32 agree, and are far above
    float16's alone (~1e-3 on this tower); layer by layer gives the whole graph's figures."""
    import onnx

    from codegen.__main__ import main
    from codegen.check.mxfp6_weights import initializers
    from codegen.export.command import ExportOptions, export
    from tests.ref.test_mxfp6 import oracle
    from weights import open_checkpoint

    ckpt, out = _tower(tmp_path / "ckpt", overflowing=False), tmp_path / "out"
    export(ExportOptions(out=out, model=ckpt, budgets=(70,), verify=False))
    model = onnx.load(str(out / "vision.onnx"), load_external_data=False)
    before = {t.name: t.SerializeToString() for t in model.graph.initializer}
    checkpoint = open_checkpoint(ckpt)
    rounded = 0
    for t in initializers(model, checkpoint, "e3m2").graph.initializer:
        if len(t.dims) < 2 or t.name == "patch_embedder.position_embedding_table":
            assert t.SerializeToString() == before[t.name], t.name
            continue
        want = oracle(np.asarray(checkpoint.read(t.name), np.float32), "e3m2")
        np.testing.assert_array_equal(_bfloat16_values(t).view(np.uint32), want.view(np.uint32))
        rounded += 1
    assert rounded == 3 * 7 + 1, rounded  # 7 linears a layer, the patch projection
    assert main(["verify", str(out), "--mxfp6"]) == 2  # needs --precision
    figures = []
    for way in ([], ["--layerwise"]):
        assert main(["verify", str(out), *way, "--precision", "fp16", "--mxfp6", "e3m2"]) == 0
        text = capsys.readouterr().out
        assert "matmul weights as MXFP6 (e3m2)" in text
        figures.append(_pooled_errors(text))
    (ref_err, onnx_err), layered = figures
    assert ref_err > 1e-2 and abs(onnx_err - ref_err) < 0.05 * ref_err, figures
    np.testing.assert_allclose(layered, figures[0], rtol=1e-2)


def _softmax_rows(scores, visible):
    """Softmax of each row over its visible entries (numpy, float64); rows seeing none → 0."""
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    w = np.where(visible, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    return w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-300)


def test_block_ordering_stays_finite_in_float16():
    """The dependency that orders blocks (each block's queries wait for the state before) must
    not grow with the block: a sum of l over 4 heads × 600 queries of 200 keys (~4.8e5) is inf in
    float16 and 0·inf turned every later block to NaN. Tiled vision attention (3×3 tiles, one
    item and filler) and `blocked(ordered=True)` (4 causal KV blocks of 128) in the float16
    device model against numpy float64: finite, within FP16_BOUND."""
    from ref.attention import blocked
    from ref.gemma4.vision import tiled_packed_attention

    rng = np.random.default_rng(21)
    n, heads, d = 600, 4, 16
    q, k, v = (rng.normal(size=(n, heads, d)).astype(np.float32) * 0.3 for _ in range(3))
    ids = np.where(np.arange(n) < 580, 0, -1).astype(np.int32)
    run = jax.jit(numerics.emulate(lambda *a: tiled_packed_attention(*a, tiles=(3, 3)), "fp16"))
    got = np.asarray(run(q, k, v, ids))
    same = (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
    w = _softmax_rows(np.einsum("qhd,khd->hqk", q, k).astype(np.float64), same[None])
    want = np.einsum("hqk,khd->qhd", w, v.astype(np.float64))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= FP16_BOUND * np.abs(want).max()

    t = 512
    qb, kb, vb = (rng.normal(size=(1, heads, t, d)).astype(np.float32) * 0.3 for _ in range(3))
    pos = np.arange(t)[None]
    fn = partial(blocked, mode="kv", num_kv_blocks=4, ordered=True)
    got = np.asarray(jax.jit(numerics.emulate(fn, "fp16"))(qb, kb, vb, pos, pos))
    causal = pos[0][None, :] <= pos[0][:, None]
    w = _softmax_rows(np.einsum("bhqd,bhkd->bhqk", qb, kb).astype(np.float64), causal)
    want = np.einsum("bhqk,bhkd->bhqd", w, vb.astype(np.float64))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= FP16_BOUND * np.abs(want).max()


def test_mxfp6_weights_move_the_soft_tokens_by_their_rounding(default_model):
    """`drift --mxfp6`'s model: the matmul weights are `ref.mxfp6`'s round trip, the embedding
    table untouched, and the vision tower's soft tokens move by more than float32 noise and
    less than the weights' own rounding allows; E3M2 (one mantissa bit fewer) moves them more
    than E2M3."""
    from codegen.check.drift import random_prompt, with_mxfp6
    from ref import mxfp6

    stored = with_mxfp6(default_model, "e2m3")
    q = ("layers", "0", "self_attn", "q_proj", "weight")
    pick = lambda tree: reduce(lambda t, k: t[k], q, tree)  # noqa: E731
    np.testing.assert_array_equal(pick(stored.params), mxfp6.round_trip(pick(default_model.params)))
    assert stored.params["embed_tokens"]["weight"] is default_model.params["embed_tokens"]["weight"]
    _, patches, grids = random_prompt(default_model, np.random.default_rng(0))
    want = default_model.vision.embed(patches, grids)[0]
    moved = {}
    for element in ("e2m3", "e3m2"):
        got = with_mxfp6(default_model, element).vision.embed(patches, grids)[0]
        moved[element] = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert 1e-4 < moved["e2m3"] < moved["e3m2"] < 0.5, moved


@settings(max_examples=examples(40), deadline=None)
@given(
    st.lists(stat_values | st.floats(-1e4, 1e4, width=32), min_size=2, max_size=12),
    st.lists(st.booleans(), min_size=12, max_size=12),
    st.sampled_from([1.0, 2.0, 300.0]),
)
def test_selected_values_are_not_rounded_or_probed_and_answers_stand(values, mask, scale):
    """A masked softmax's pieces that only select values (Where with a −inf fill, ReduceMax)
    get neither a rounding pair nor statistics (`moves`); the largest finite |x| over what is
    probed, and the first tensor named non-finite (`first_nonfinite_name`), are numpy's over
    every tensor, the selections included (the Sub after the −inf fill is not named: its −inf
    came from the fill). Graph: s = x·scale, w = Where(mask, s, −inf), m = ReduceMax(w),
    d = w − m, e = exp(d), each rounded to float16 in numpy as the device rounds it."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from codegen.check.device_graph import device_graph, first_nonfinite_name, stats_of

    n = len(values)
    nodes = [
        helper.make_node("Constant", [], ["fill"], value=helper.make_tensor(
            "v", TensorProto.FLOAT, [], [-np.inf])),
        helper.make_node("Mul", ["x", "scale"], ["s"]),
        helper.make_node("Where", ["mask", "s", "fill"], ["w"]),
        helper.make_node("ReduceMax", ["w"], ["m"], keepdims=1),
        helper.make_node("Sub", ["w", "m"], ["d"]),
        helper.make_node("Exp", ["d"], ["e"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [n])],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [n])],
        initializer=[helper.make_tensor("scale", TensorProto.FLOAT, [], [scale])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x, keep = np.asarray(values, np.float32), np.asarray(mask[:n])
    m, names, outputs = device_graph(model, "float16", stats=True)
    assert "w" not in names and "m" not in names and {"s", "d", "e"} <= set(names), names
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip(outputs, session.run(outputs, {"x": x, "mask": keep}), strict=True))
    stats = stats_of(got, names)
    producers = {o: nd for nd in model.graph.node for o in nd.output}

    def r(t):
        return np.asarray(t, np.float32).astype(np.float16).astype(np.float32)

    with np.errstate(all="ignore"):
        xr = r(x)
        s = r(xr * np.float32(scale))
        w = np.where(keep, s, np.float32(-np.inf))
        mx = w.max(keepdims=True)
        d = r(w - mx)
        tensors = {
            "fill": np.float32([-np.inf]),
            "s": s,
            "w": w,
            "m": mx,
            "d": d,
            "e": r(np.exp(d)),
        }
    reads = {"fill": [], "s": ["x"], "w": ["s", "fill"], "m": ["w"], "d": ["w", "m"], "e": ["d"]}
    # an input is read as the caller gave it (`_known`): its rounding's overflow is named at
    # its first reader
    finite = {"x": bool(np.isfinite(x).all()), **{k: bool(np.isfinite(t).all())
                                                  for k, t in tensors.items()}}  # fmt: skip
    want = None
    for k in ("s", "w", "m", "d", "e"):
        if np.isnan(tensors[k]).any() or (not finite[k] and all(finite[i] for i in reads[k])):
            want = k
            break
    known = {**stats, "x": (0.0, False, finite["x"])}  # as `layered_precision._known` adds it
    assert first_nonfinite_name(known, names, producers) == want
    peaks = [
        float(np.abs(t[np.isfinite(t)]).max()) for t in tensors.values() if np.isfinite(t).any()
    ]
    if not any(np.isnan(t).any() for t in tensors.values()):  # a NaN: reductions differ
        assert max((stats[k][0] for k in names), default=0.0) == max(peaks, default=0.0)
