"""Blocked attention and the cache scatter export through jax2onnx without Loop or Einsum, and
onnxruntime reproduces JAX on the exported graph (float32, ≤ 2e-6 relative)."""

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
from jax2onnx import to_onnx

from codegen.ops import ALLOWED_OPS
from ref import cache
from ref.attention import blocked


def step(q, k, v, q_pos, kv_pos, q_group, kv_group, past, slots):
    out = blocked(
        q,
        k,
        v,
        q_pos,
        kv_pos,
        q_group=q_group,
        kv_group=kv_group,
        mode="hqkv",
        head_block_size=2,
        num_q_blocks=2,
        num_kv_blocks=3,
        sliding_window=4,
        skip_kv=True,
        softcap=5.0,
    )
    return out, cache.scatter(past, k[:, :, :3], slots)


def test_blocked_and_scatter_export_to_onnx_without_loops():
    spec = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    shapes = [
        spec((2, 4, 5, 8), f32),
        spec((2, 2, 10, 8), f32),
        spec((2, 2, 10, 8), f32),
        spec((2, 5), i32),
        spec((2, 10), i32),
        spec((2, 5), i32),
        spec((2, 10), i32),
        spec((2, 2, 10, 8), f32),
        spec((2, 3), i32),
    ]
    model = to_onnx(step, shapes)
    ops = {node.op_type for node in model.graph.node}
    assert ops <= ALLOWED_OPS, ops - ALLOWED_OPS
    assert "ScatterND" in ops

    rng = np.random.default_rng(0)
    q, k, v, past = (rng.normal(size=shapes[i].shape).astype(np.float32) for i in (0, 1, 2, 7))
    q_pos = np.array([[3, 4, 5, 6, -1], [0, 1, 2, 3, 4]], np.int32)
    kv_pos = np.array([[0, 1, 2, 3, 4, 5, 6, -1, -1, -1], list(range(5)) + [-1] * 5], np.int32)
    runs = np.array([-1, -1, 0, 0, 0, -1, 1, 1, -1, -1], np.int32)
    q_group = np.where(q_pos >= 0, runs[np.maximum(q_pos, 0)], -1).astype(np.int32)
    kv_group = np.where(kv_pos >= 0, runs[np.maximum(kv_pos, 0)], -1).astype(np.int32)
    slots = np.array([[7, -1, 2], [0, 1, 9]], np.int32)
    inputs = [q, k, v, q_pos, kv_pos, q_group, kv_group, past, slots]
    session = ort.InferenceSession(model.SerializeToString())
    feed = {i.name: x for i, x in zip(session.get_inputs(), inputs, strict=True)}
    got = session.run(None, feed)
    want = step(*inputs)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        assert np.abs(g - w).max() <= 2e-6 * max(np.abs(w).max(), 1.0)


def test_cache_update_exports_with_symbolic_batch_and_length():
    """The retained-state write traces with symbolic B and S (no arange/zeros of a symbolic
    size) and onnxruntime reproduces it exactly, −1 slots included."""

    def write(ck, cv, k, v, pos):
        return (*cache.update(ck, cv, k, v, pos), cache.causal_positions(pos, 16))

    spec = jax.ShapeDtypeStruct
    f32 = jnp.float32
    model = to_onnx(
        write,
        [
            spec(("B", 2, 16, 4), f32),
            spec(("B", 2, 16, 4), f32),
            spec(("B", 2, "S", 4), f32),
            spec(("B", 2, "S", 4), f32),
            spec(("B", "S"), jnp.int32),
        ],
    )
    rng = np.random.default_rng(1)
    inputs = [
        rng.normal(size=shape).astype(np.float32)
        for shape in ((3, 2, 16, 4), (3, 2, 16, 4), (3, 2, 5, 4), (3, 2, 5, 4))
    ]
    inputs.append(np.array([[0, 1, 2, 3, 4], [7, 8, -1, -1, -1], [15, -1, -1, -1, -1]], np.int32))
    session = ort.InferenceSession(model.SerializeToString())
    got = session.run(None, {i.name: x for i, x in zip(session.get_inputs(), inputs, strict=True)})
    for g, w in zip(got, write(*inputs), strict=True):
        assert (g == np.asarray(w)).all()
