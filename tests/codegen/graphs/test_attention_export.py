"""Blocked attention and the cache scatter export through jax2onnx without Loop or Einsum, and
onnxruntime reproduces JAX on the exported graph (float32, ≤ 2e-6 relative)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import onnxruntime as ort
from hypothesis import given, settings
from hypothesis import strategies as st
from jax2onnx import to_onnx

from codegen.lower.ops import ALLOWED_OPS
from ref import cache
from ref.attention import blocked
from tests.util import examples


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


@functools.cache
def _writes():
    """`cache.scatter` (and with `rows`), `scatter_positions` and `put_rows` traced once, shapes
    fixed: cache [3, 2, 6, 4], new [3, 2, 4, 4], slots [3, 4]; rows [3] into [5, 6] and into a
    cache of 5 slots [5, 2, 6, 4]."""

    def writes(old, new, pos, slots, table, rows, slotted):
        return (
            cache.scatter(old, new, slots),
            cache.scatter_positions(pos, slots, slots),
            cache.put_rows(table, table[:3] + 1, rows),
            cache.scatter(slotted, new, slots, rows),
        )

    spec = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    shapes = [spec((3, 2, 6, 4), f32), spec((3, 2, 4, 4), f32), spec((3, 6), i32),
              spec((3, 4), i32), spec((5, 6), f32), spec((3,), i32),
              spec((5, 2, 6, 4), f32)]  # fmt: skip
    model = to_onnx(writes, shapes)
    return model, ort.InferenceSession(model.SerializeToString())


@st.composite
def _distinct_or_invalid(draw, n, t):
    """n slots: distinct ones in [0, t), the rest −1, −2, t or t + 3 (write nothing), shuffled."""
    valid = draw(st.lists(st.integers(0, t - 1), max_size=n, unique=True))
    bad = st.sampled_from([-1, -2, t, t + 3])
    return draw(
        st.permutations(
            valid + draw(st.lists(bad, min_size=n - len(valid), max_size=n - len(valid)))
        )
    )


@settings(max_examples=examples(25), deadline=None)
@given(st.data(), st.integers(0, 2**32 - 1))
def test_a_write_in_onnxruntime_is_one_scatter_into_the_cache(data, seed):
    """Every write (`scatter` along slots, with `rows` too, `scatter_positions`, `put_rows`
    along rows) is one ScatterND straight into the input array, no copy of it beside (a spare
    slot concatenated and sliced off cost a whole cache per write; continuous batching's rows
    taken out and put back, two more); with invalid slots anywhere in a row, rows with no valid
    slot, invalid rows, and slot 0 both written and not, onnxruntime equals a loop (exactly)."""
    model, session = _writes()
    names = [i.name for i in model.graph.input]
    scatters = [n for n in model.graph.node if n.op_type == "ScatterND"]
    arrays = {names[0], names[2], names[4], names[6]}
    assert len(scatters) == 4 and {n.input[0] for n in scatters} == arrays
    assert not [
        n for n in model.graph.node if n.op_type in ("Concat", "Pad") and arrays & set(n.input)
    ]
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(3, 2, 6, 4)).astype(np.float32)
    new = rng.normal(size=(3, 2, 4, 4)).astype(np.float32)
    pos = rng.integers(-1, 9, size=(3, 6)).astype(np.int32)
    slots = np.array([data.draw(_distinct_or_invalid(4, 6)) for _ in range(3)], np.int32)
    table = rng.normal(size=(5, 6)).astype(np.float32)
    rows = np.array(data.draw(_distinct_or_invalid(3, 5)), np.int32)
    slotted = rng.normal(size=(5, 2, 6, 4)).astype(np.float32)
    want_cache, want_pos, want_table = old.copy(), pos.copy(), table.copy()
    want_slotted = slotted.copy()
    for b in range(3):
        for i, slot in enumerate(slots[b]):
            if 0 <= slot < 6:
                want_cache[b, :, slot] = new[b, :, i]
                want_pos[b, slot] = slot
                if 0 <= rows[b] < 5:
                    want_slotted[rows[b], :, slot] = new[b, :, i]
    for i, row in enumerate(rows):
        if 0 <= row < 5:
            want_table[row] = table[i] + 1
    feed = [old, new, pos, slots, table, rows, slotted]
    got = session.run(None, dict(zip(names, feed, strict=True)))
    for g, w in zip(got, [want_cache, want_pos, want_table, want_slotted], strict=True):
        assert g.dtype == w.dtype and (g == w).all()
