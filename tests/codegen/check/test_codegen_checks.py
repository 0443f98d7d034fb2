"""The checks every written graph must pass (each shown to fail on the defect it guards), and
exported graphs against independent oracles: transformers' Gemma 4 vision model and text
attention, and the dense attention reference for every blocking mode, on hypothesis-drawn
configs and shapes."""

import contextlib
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from codegen import graphs
from codegen.check import structure as checks
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import DEFAULT_CONFIG, default_checkpoint
from codegen.folder import external
from codegen.graphs import attention as attention_graph
from codegen.lower import trace as trace_module
from codegen.lower.trace import trace
from ref.blocking import DENSE_NAMES, default_options
from ref.blocking import names as blocking_names
from ref.gemma4.config import VisionConfig
from ref.gemma4.packing import pack, pack_patches
from ref.gemma4.params import attention_param_shapes
from tests.hf_vision import hf_full_model, hf_padded_inputs
from tests.strategies import grids, vision_configs
from tests.util import examples, rel_err, vision_runs
from weights import open_checkpoint, save_checkpoint

RTOL = 1e-5  # max|onnxruntime − oracle| / max|oracle|, float32 on both sides


class _Info:
    def __init__(self, shape):
        self.shape = shape


def _spec(fn, inputs, outputs, weights, specializations):
    return graphs.GraphSpec(
        name="probe",
        kind="test",
        options={},
        inputs=inputs,
        outputs=outputs,
        weights=tuple(weights),
        fn=fn,
        reference=None,
        sample=None,
        specializations=specializations,
    )


def test_shape_check_catches_jax2onnx_symbolic_concat(monkeypatch):
    """jax2onnx 0.17.1's `jnp.concatenate` declares the first operand's size along a symbolic
    axis: the trace patches it (`_concatenated_symbolic_sizes`), and without the patch the
    shape check catches the wrong declaration."""

    def fn(x, y, w):
        return (jnp.concatenate([x, y], axis=0) * w,)

    spec = _spec(
        fn,
        (graphs.Tensor("x", ("n", 4), "float32"), graphs.Tensor("y", ("m", 4), "float32")),
        (graphs.Tensor("out", ("n + m", 4), "float32"),),  # the size as jax2onnx labels it
        ["w"],
        ({"name": "s", "symbols": {"n": 2, "m": 3, "n + m": 5}},),
    )
    slices = checks.no_unclamped_dynamic_slice(spec, {"w": (4,)})
    checks.inferred_shapes(trace(spec, {"w": _Info((4,))}), spec, slices)
    monkeypatch.setattr(trace_module, "_concatenated_symbolic_sizes", contextlib.nullcontext)
    model = trace(spec, {"w": _Info((4,))})
    with pytest.raises(checks.CheckError, match=r"ref gives \(5, 4\), graph declares \(2, 4\)"):
        checks.inferred_shapes(model, spec, slices)


def test_shape_check_passes_a_right_graph_and_catches_a_wrong_spec():
    def fn(x, w):
        return (x * w,)

    inputs = (graphs.Tensor("x", ("n", 4), "float32"),)
    ok = _spec(
        fn,
        inputs,
        (graphs.Tensor("out", ("n", 4), "float32"),),
        ["w"],
        ({"name": "s", "symbols": {"n": 3}},),
    )
    model = trace(ok, {"w": _Info((4,))})
    checks.inferred_shapes(model, ok, checks.no_unclamped_dynamic_slice(ok, {"w": (4,)}))
    wrong = _spec(
        fn, inputs, (graphs.Tensor("out", ("n", 5), "float32"),), ["w"], ok.specializations
    )
    with pytest.raises(checks.CheckError, match="spec declares"):
        checks.inferred_shapes(model, wrong, checks.no_unclamped_dynamic_slice(ok, {"w": (4,)}))


@pytest.mark.parametrize("traced_start", [True, False])
def test_dynamic_slice_guard(traced_start):
    def fn(x, i, w):
        start = i[0] if traced_start else jnp.int32(1)  # folded from constants: allowed
        return (jax.lax.dynamic_slice(x, (start,), (2,)) * w,)

    spec = _spec(
        fn,
        (graphs.Tensor("x", (6,), "float32"), graphs.Tensor("i", (1,), "int32")),
        (graphs.Tensor("out", (2,), "float32"),),
        ["w"],
        ({"name": "s", "symbols": {}},),
    )
    if traced_start:
        with pytest.raises(checks.CheckError, match="dynamic_slice with a run-time start"):
            checks.no_unclamped_dynamic_slice(spec, {"w": (2,)})
    else:
        checks.no_unclamped_dynamic_slice(spec, {"w": (2,)})


class _Slicer(nn.Module):
    """A layer reading x at a traced start: what the guard must find inside a layer function."""

    scale: float

    @nn.compact
    def __call__(self, x, i):
        w = self.param("weight", nn.initializers.ones, (2,))
        return x.at[:2].add(jax.lax.dynamic_slice(x, (i[0],), (2,)) * w * self.scale)


class _Slicers(nn.Module):
    scale: float

    @nn.compact
    def __call__(self, x, i):
        return _Slicer(self.scale, name="1")(_Slicer(self.scale, name="0")(x, i), i)


def test_dynamic_slice_guard_sees_into_layer_functions():
    """The checks trace each layer kind once per scope (`layer_scope(once=True)`: one jitted
    function its layers share, as their ONNX function is one, and not a trace from an earlier
    scope); the guard still finds a run-time start inside it, and the output shapes it hands on
    are `ref_shapes`'."""
    scale = {"value": 2.5}

    def fn(x, i, w0, w1):
        route = graphs.route_layers(_Slicer, True, lambda module: "Slicer")
        params = {"0": {"weight": w0}, "1": {"weight": w1}}
        with nn.intercept_methods(route):
            return (_Slicers(scale["value"]).apply({"params": params}, x, i),)

    spec = _spec(
        fn,
        (graphs.Tensor("x", (6,), "float32"), graphs.Tensor("i", (1,), "int32")),
        (graphs.Tensor("out", (6,), "float32"),),
        ["w0", "w1"],
        ({"name": "s", "symbols": {}},),
    )
    shapes = {"w0": (2,), "w1": (2,)}
    weights = [jax.ShapeDtypeStruct((2,), "float32")] * 2
    inputs = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in spec.inputs]
    with graphs.layer_scope(once=True):  # a new outer function: make_jaxpr caches by function
        closed = jax.make_jaxpr(lambda *a: fn(*a))(*inputs, *weights)
    layers = [e.params["jaxpr"] for e in closed.jaxpr.eqns if "jaxpr" in e.params]
    assert len(layers) == 2 and layers[0] is layers[1]  # traced once, called twice
    assert "2.5" in str(layers[0])
    scale["value"] = 3.5  # same shapes, another layer body: traced again in a new scope
    with graphs.layer_scope(once=True):  # a new outer function: make_jaxpr caches by function
        closed = jax.make_jaxpr(lambda *a: fn(*a))(*inputs, *weights)
    assert "3.5" in str(closed) and "2.5" not in str(closed)
    assert checks.ref_shapes(spec, checks.ref_trace(spec, shapes)) == {"s": {"out": (6,)}}
    with pytest.raises(checks.CheckError, match="dynamic_slice with a run-time start"):
        checks.no_unclamped_dynamic_slice(spec, shapes)


def _model(nodes, functions=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    graph = helper.make_graph(nodes, "g", [x], [y])
    return helper.make_model(
        graph,
        functions=list(functions),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("custom", 1)],
    )


def test_allow_list():
    checks.allowed_ops(_model([helper.make_node("MatMul", ["x", "x"], ["y"])]))
    with pytest.raises(checks.CheckError, match="Einsum"):
        checks.allowed_ops(
            _model([helper.make_node("Einsum", ["x", "x"], ["y"], equation="ij,jk->ik")])
        )
    body = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "b", [], [])
    with pytest.raises(checks.CheckError, match="Loop"):
        fn = helper.make_function(
            "custom",
            "F",
            ["x"],
            ["y"],
            [helper.make_node("Loop", ["", ""], ["y"], body=body)],
            [helper.make_opsetid("", 18)],
        )
        checks.allowed_ops(_model([helper.make_node("F", ["x"], ["y"], domain="custom")], [fn]))
    with pytest.raises(checks.CheckError, match="custom.Unknown"):
        checks.allowed_ops(_model([helper.make_node("Unknown", ["x"], ["y"], domain="custom")]))


def _external(location, length=4):
    t = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1])
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v
    model = _model([helper.make_node("Add", ["x", "w"], ["y"])])
    model.graph.initializer.append(t)
    return model


def test_external_paths(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "w.bin").write_bytes(b"\0" * 4)
    (tmp_path / "outside.bin").write_bytes(b"\0" * 4)
    os.symlink(tmp_path / "outside.bin", out / "link.bin")
    checks.external_paths(_external("w.bin"), out)
    for location in ("../outside.bin", str(tmp_path / "outside.bin"), "./w.bin", "sub/../w.bin"):
        with pytest.raises(checks.CheckError, match="leaves the output folder"):
            checks.external_paths(_external(location), out)
    with pytest.raises(checks.CheckError, match="leaves the output folder|not a regular file"):
        checks.external_paths(_external("link.bin"), out)
    with pytest.raises(checks.CheckError, match="bytes up to 8"):
        checks.external_paths(_external("w.bin", length=8), out)


def test_checker_rejects_a_broken_graph():
    model = _model([helper.make_node("Add", ["x", "missing"], ["y"])])
    with pytest.raises(checks.CheckError, match="onnx.checker"):
        checks.checker(model)


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return open_checkpoint(default_checkpoint(tmp_path_factory.mktemp("cache") / "default"))


@settings(max_examples=examples(12), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from([n for n in blocking_names() if n not in DENSE_NAMES]),
    batch=st.integers(1, 2),
    seq_len=st.integers(1, 9),
    ctx_len=st.integers(9, 40),
    blocks=st.integers(1, 3),
    layers=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_blocked_attention_graph_matches_dense_reference(
    default_model, mode, batch, seq_len, ctx_len, blocks, layers, seed
):
    """onnxruntime on the exported blocked graph vs the dense `ref.attention.reference`."""
    options = {
        k: (
            blocks if isinstance(v, int) and not isinstance(v, bool) and k != "headpar_split" else v
        )
        for k, v in default_options(mode)[1].items()
    }
    shapes = {n: i.shape for n, i in default_model.tensors.items()}
    try:
        spec = attention_graph.attention_graph(
            DEFAULT_CONFIG,
            shapes,
            name="a",
            mode=mode,
            options=options,
            layers=layers,
            batch_size=batch,
            seq_len=seq_len,
            ctx_len=ctx_len,
        )
    except graphs.GraphError:
        assume(False)
    model = trace(spec, default_model.tensors)
    checks.allowed_ops(model)
    checks.checker(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    weights = {n: default_model.read(n).astype(np.float32) for n in spec.weights}
    feed = spec.sample(spec.specializations[0]["symbols"], np.random.default_rng(seed))
    got = session.run(None, {**feed, **weights})
    with graphs.layer_scope():
        want = spec.reference(feed, weights)
    for t, out in zip(spec.outputs, got, strict=True):
        assert out.shape == want[t.name].shape
        assert rel_err(out, want[t.name]) <= RTOL, (t.name, mode, options)


@settings(max_examples=examples(3), deadline=None)
@given(cfg=vision_configs(max_layers=2), grid_list=grids(max_items=3), seed=st.integers(0, 99))
def test_exported_vision_graph_matches_transformers(cfg, grid_list, seed, tmp_path_factory):
    """The whole path: an HF model's weights saved as a checkpoint, `export`, onnxruntime on
    the written folder vs transformers' `get_image_features` on the same images."""
    assume(sum(h * w for h, w in grid_list) <= 70 * 9)
    cfg = VisionConfig(**{**cfg.__dict__, "text_hidden_size": 20})
    model = hf_full_model(cfg, seed, text_hidden=20)
    state = {
        n: t.detach().numpy().copy()
        for n, t in model.state_dict().items()
        if n.startswith(("model.vision_tower.", "model.embed_vision."))
    }
    root = tmp_path_factory.mktemp("hf")
    save_checkpoint(root / "model", json.loads(model.config.to_json_string()), state)
    export(
        ExportOptions(
            out=root / "out", model=root / "model", budgets=(70,), blocking=(), verify=False
        )
    )
    rng = np.random.default_rng(seed)
    patches = [rng.random((h * w, cfg.patch_dim), dtype=np.float32) for h, w in grid_list]
    values, pos = hf_padded_inputs(patches, grid_list)
    with torch.no_grad():
        expected = model.get_image_features(values, pos).pooler_output
    expected = np.concatenate([np.asarray(e) for e in expected])
    packing = pack(grid_list, position_embedding_size=cfg.position_embedding_size, budget=70)
    session = ort.InferenceSession(
        str(root / "out" / "vision.onnx"), providers=["CPUExecutionProvider"]
    )
    (got,) = session.run(
        None,
        {
            "pixel_patches": pack_patches(patches, grid_list, cfg.patch_dim, packing),
            "positions": packing.positions,
            "segment_ids": packing.segment_ids,
            "pool_index": packing.pool_index,
        },
    )
    assert got.shape == (70, 20)
    assert rel_err(got[: packing.num_real_tokens], expected) <= RTOL


def test_inputs_to_initializers_roundtrip(default_model):
    """The verify-time binding of a `--weights inputs` graph names exactly the spec's bytes."""
    spec = attention_graph.attention_graph(
        DEFAULT_CONFIG,
        {n: i.shape for n, i in default_model.tensors.items()},
        name="a",
        mode="kv",
        options={"num_kv_blocks": 2},
        layers=1,
        batch_size=1,
        seq_len=4,
        ctx_len=16,
    )
    model = trace(spec, default_model.tensors)
    ws = external.as_inputs(model, spec.weights, default_model.tensors, "a", default_model.dir)
    bound = external.inputs_to_initializers(
        onnx.ModelProto.FromString(model.SerializeToString()),
        ws,
        default_model.tensors,
        default_model.dir,
    )
    names = {t.name for t in bound.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert names == set(spec.weights)
    assert not names & {i.name for i in bound.graph.input}


def _hf_mask(pos, groups, layer_type, window):
    """Independent numpy mask [B, 1, S, S] (0 / −inf) for an empty-cache prefill: causal; sliding
    layers add the window and let a vision run see itself both ways."""
    qp, kp = pos[:, None, :, None], pos[:, None, None, :]
    visible = kp <= qp
    if layer_type == "sliding_attention":
        qg, kg = groups[:, None, :, None], groups[:, None, None, :]
        visible = (visible | ((qg == kg) & (qg >= 0))) & (qp - kp < window)
    return np.where(visible, 0.0, -np.inf).astype(np.float32)


@settings(max_examples=examples(4), deadline=None)
@given(
    k_eq_v=st.booleans(),
    mode=st.sampled_from(["none", "kv", "hqkv", "kv_batch_fold"]),
    batch=st.integers(1, 2),
    seq_len=st.integers(2, 8),
    seed=st.integers(0, 2**16),
)
def test_attention_graph_is_transformers_text_attention(k_eq_v, mode, batch, seq_len, seed):
    """The exported attention stack (a sliding then a full layer, each `h + self_attn(h)`) in
    onnxruntime vs transformers' Gemma4TextAttention of a randomized model, prefill from an
    empty cache with a vision run per row."""
    from tests.text_oracle import hf_model, text_config

    layer_types = ["sliding_attention", "full_attention"]
    hf = hf_model(text_config(moe=False, layer_types=layer_types, k_eq_v=k_eq_v, window=3), seed)
    lm = hf.model.language_model
    state = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    shapes = {k: v.shape for k, v in state.items()}
    options = {}
    spec = attention_graph.attention_graph(
        hf.config.to_dict(),
        shapes,
        name="a",
        mode=mode,
        options=options,
        layers=2,
        batch_size=batch,
        seq_len=seq_len,
        ctx_len=seq_len + 3,
    )
    rng = np.random.default_rng(seed)
    pos = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy()
    feed = {
        "hidden_states": rng.standard_normal((batch, seq_len, 32), dtype=np.float32),
        "position_ids": pos,
        "group_ids": np.stack([vision_runs(rng, seq_len) for _ in range(batch)]).astype(np.int32),
    }
    for t in spec.inputs[3:]:
        feed[t.name] = np.zeros(t.concrete(spec.specializations[0]["symbols"]), np.float32)
    model = trace(spec, state)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {**feed, **{n: state[n] for n in spec.weights}})[0]

    h = torch.from_numpy(feed["hidden_states"])
    with torch.no_grad():
        for i, layer_type in enumerate(layer_types):
            rope = lm.rotary_emb(h, torch.from_numpy(pos).long(), layer_type)
            mask = torch.from_numpy(_hf_mask(pos, feed["group_ids"], layer_type, 3))
            out, _ = lm.layers[i].self_attn(h, rope, mask, {})
            h = h + out
    assert rel_err(got, h.numpy()) <= RTOL


@pytest.mark.parametrize(
    "layer_types, shared, head_dims, want",
    [
        (["sliding_attention", "full_attention", "sliding_attention"], 0, None, 3),
        # KV-sharing consumers own no cache: the stack ends before them
        (
            ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            2,
            None,
            2,
        ),
        # a second sliding head layout cannot share the sliding layers' ONNX function
        (
            ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            0,
            {"2": 16},
            2,
        ),
    ],
)
def test_stackable_attention_layers(layer_types, shared, head_dims, want):
    """How many leading layers an attention graph stacks; a missing tensor ends the stack and
    asking for more layers is a GraphError."""
    from tests.text_oracle import text_config

    text = text_config(moe=False, layer_types=layer_types, shared=shared)
    if head_dims is not None:
        full = {"head_dim": text["global_head_dim"]}
        text["per_layer_config"] = {
            str(i): {"head_dim": head_dims[str(i)]}
            if str(i) in head_dims
            else (full if t == "full_attention" else {})
            for i, t in enumerate(layer_types)
        }
    config = {"text_config": text}
    cfg = graphs.text_config(config)
    shapes = {}
    for i in range(len(layer_types)):
        if not cfg.shares_kv(i):
            shapes.update(attention_param_shapes(cfg, i))
    assert attention_graph.attention_layers_available(config, shapes) == want
    missing = {n: s for n, s in shapes.items() if ".1.self_attn.q_norm" not in n}
    assert attention_graph.attention_layers_available(config, missing) == 1
    with pytest.raises(graphs.GraphError, match="stackable"):
        attention_graph.attention_graph(
            config,
            shapes,
            name="a",
            mode="none",
            options={},
            layers=want + 1,
            batch_size=1,
            seq_len=2,
            ctx_len=4,
        )


def test_sessions_run_nodes_in_the_graphs_order(tmp_path):
    """Every session of an export runs its nodes in the order the graph lists them (the order
    `ref` traced), not onnxruntime's default depth-first walk back from the outputs, which
    would transpose a weight listed just before its late MatMul first and hold it throughout
    (31B prefill: 1.2 GB of MLP weights alive through attention). Read from a profile."""
    from onnx import TensorProto, helper

    from codegen.folder import sessions as folder

    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"], name="second"),
        helper.make_node("Transpose", ["w2"], ["w2t"], perm=[1, 0], name="third"),
        helper.make_node("MatMul", ["r", "w2t"], ["y"], name="fourth"),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "order",
        [value(n, f32, [2, 2]) for n in ("x", "w1", "w2")],
        [value("y", f32, [2, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    opts = folder.options()
    assert opts.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusing
    opts.enable_profiling = True
    opts.profile_file_prefix = str(tmp_path / "profile")
    session = ort.InferenceSession(model.SerializeToString(), opts)
    session.run(None, {n: np.eye(2, dtype=np.float32) for n in ("x", "w1", "w2")})
    events = json.load(open(session.end_profiling()))
    ran = [e["name"].removesuffix("_kernel_time") for e in events
           if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]  # fmt: skip
    assert ran == ["first", "second", "third", "fourth"]
