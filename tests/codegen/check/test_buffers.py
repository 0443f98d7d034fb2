"""`codegen.check.layer_buffers`: layer weights read into reused buffers, never into one an
array still uses, and rounded to the device's format (`stored_weights`); `weights.read_tensor(
out=)`."""

import gc
import json
from types import SimpleNamespace
from unittest import mock

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import weights
from codegen.check import layer_buffers
from codegen.check.layer_buffers import Buffers, stored_weights
from tests.util import examples

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


@st.composite
def layers(draw):
    """[[(name, array)] per layer]: 2–4 layers of 1–3 tensors each, shapes and stored types
    drawn, values standard normal."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    out = []
    for k in range(draw(st.integers(2, 4))):
        tensors = []
        for j in range(draw(st.integers(1, 3))):
            shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
            dtype = draw(st.sampled_from(DTYPES))
            tensors.append((f"l{k}.w{j}", rng.standard_normal(shape).astype(dtype)))
        out.append(tensors)
    return out


def _checkpoint(tmp_path, drawn):
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    weights.write_safetensors(folder / "model.safetensors",
                              {n: a for layer in drawn for n, a in layer})  # fmt: skip
    (folder / "config.json").write_text(json.dumps({"model_type": "test"}))
    return weights.open_checkpoint(folder)


@settings(max_examples=examples(10), deadline=None)
@given(layers(), st.lists(st.booleans(), min_size=4, max_size=4))
def test_buffers_are_reused_only_when_no_array_uses_them(tmp_path_factory, drawn, hold):
    """Each layer read through one `Buffers` equals the checkpoint's values as float32, and
    the arrays of a layer that are still held — as they are, as a transposed view, or shared
    by a jax array — keep their values while later layers are read; reading the layers again
    with nothing held allocates no new buffer (garbage collected from any size of buffers in
    use: a jax array lets its buffer go only when collected). Fails when a buffer in use is
    handed out again (the reference count not checked) and when a free one is not reused."""
    with mock.patch.object(layer_buffers, "RECLAIM_BYTES", 0):
        _reuse(_checkpoint(tmp_path_factory.mktemp("b"), drawn), drawn, hold)


def _reuse(ckpt, drawn, hold):
    buffers, held = Buffers(), []
    for k, layer in enumerate(drawn):
        got = [buffers.read(ckpt, n) for n, _ in layer]
        for (n, a), g in zip(layer, got, strict=True):
            assert g.dtype == np.float32 and g.flags.c_contiguous and g.ctypes.data % 64 == 0
            np.testing.assert_array_equal(g, a.astype(np.float32), err_msg=n)
        if hold[k]:
            for j, (g, (_, a)) in enumerate(zip(got, layer, strict=True)):
                want = a.astype(np.float32)
                held.append([(g, want), (g.T, want.T), (jax.device_put(g), want)][j % 3])
        del got, g
    assert all(np.array_equal(np.asarray(h), want) for h, want in held)
    del held
    buffers.reclaim()
    owned = len(buffers.owned)
    for layer in drawn:
        got = [buffers.read(ckpt, n) for n, _ in layer]
        del got
        buffers.reclaim()
    assert len(buffers.owned) == owned


def test_reclaim_collects_garbage_only_from_its_threshold(tmp_path, monkeypatch):
    """A buffer whose only user is garbage in a reference cycle is handed out again after
    `reclaim` once the buffers in use hold RECLAIM_BYTES (a collection frees it), and not
    below (a new buffer is allocated: cheaper than a collection). Fails when the threshold
    is ignored in either direction."""
    want = np.arange(4096, dtype=np.float32).reshape(64, 64)
    ckpt = _checkpoint(tmp_path, [[("t", want)]])
    gc.disable()  # no collection but `reclaim`'s
    try:
        for above in (False, True):
            buffers = Buffers()
            cycle = [buffers.read(ckpt, "t")]
            cycle.append(cycle)
            size, first = len(buffers.owned[0]), cycle[0].ctypes.data
            monkeypatch.setattr(layer_buffers, "RECLAIM_BYTES", size + (not above))
            del cycle
            buffers.reclaim()
            again = buffers.read(ckpt, "t")
            assert len(buffers.owned) == 2 - above and (again.ctypes.data == first) == above
            np.testing.assert_array_equal(again, want)
    finally:
        gc.enable()


def test_a_pass_collects_garbage_only_from_the_threshold(monkeypatch):
    """`collected` after a pass collects garbage and hands memory back when the graph's
    weights hold RECLAIM_BYTES or more as float32 (here 4 · (12 + 5) = 68 bytes), and does
    nothing below."""
    calls = []
    monkeypatch.setattr(layer_buffers.gc, "collect", lambda: calls.append("collect"))
    monkeypatch.setattr(layer_buffers, "give_back", lambda: calls.append("give back"))
    spec = SimpleNamespace(weights=["a", "b"])
    shapes = {"a": (3, 4), "b": (5,), "unread": (1000,)}
    checkpoint = SimpleNamespace(tensors={n: SimpleNamespace(shape=s) for n, s in shapes.items()})
    for threshold, want in ((68, ["collect", "give back"]), (69, [])):
        calls.clear()
        monkeypatch.setattr(layer_buffers, "RECLAIM_BYTES", threshold)
        layer_buffers.collected(spec, checkpoint)
        assert calls == want, threshold


def test_read_into_a_wrong_buffer_is_refused(tmp_path):
    """`out` of another dtype, shape or layout is refused, naming the tensor and both."""
    ckpt = _checkpoint(tmp_path, [[("t", np.ones((3, 4), np.float32))]])
    np.testing.assert_array_equal(ckpt.read("t", out=np.empty((3, 4), np.float32)), 1.0)
    for bad in (np.empty((4, 3), np.float32), np.empty((3, 4), np.float16),
                np.empty((4, 3), np.float32).T):  # fmt: skip
        with pytest.raises(ValueError, match=r"t: out is .*needs a C-contiguous float32\[3, 4\]"):
            ckpt.read("t", out=bad)


def test_a_tensor_of_another_type_is_read_whole_or_empty(tmp_path):
    """bfloat16 tensors read as float32 through the stage: one of no element, and one longer
    than STAGE_BYTES (made small here) — every element, in the stage's pieces."""
    big = np.arange(1000, dtype=np.float32).astype(ml_dtypes.bfloat16)
    ckpt = _checkpoint(tmp_path, [[("empty", np.ones((0, 3), ml_dtypes.bfloat16)), ("big", big)]])
    with mock.patch.object(layer_buffers, "STAGE_BYTES", 6):
        buffers = Buffers()
        assert buffers.read(ckpt, "empty").shape == (0, 3)
        np.testing.assert_array_equal(buffers.read(ckpt, "big"), big.astype(np.float32))


@settings(max_examples=examples(4), deadline=None)  # each drawn shape is a compile
@given(layers(), st.sampled_from(["float16", "bfloat16"]), st.sampled_from([1.0, 1e-6, 3e4]))
def test_stored_weights_are_the_checkpoints_values_rounded(tmp_path_factory, drawn, fmt, scale):
    """`stored_weights` of each layer (float32, bfloat16 and float16 tensors, scaled so some
    values are below float16's normal range or beyond it) equals numpy's rounding of the
    checkpoint's float32 values to the format (ml_dtypes: an oracle of its own) bit for bit;
    fails when a weight is widened without rounding."""
    with np.errstate(over="ignore"):  # float16 tensors scaled past their range hold inf
        drawn = [[(n, (a.astype(np.float32) * scale).astype(a.dtype)) for n, a in layer]
                 for layer in drawn]  # fmt: skip
    ckpt = _checkpoint(tmp_path_factory.mktemp("s"), drawn)
    buffers, low = Buffers(), {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[fmt]
    for layer in drawn:
        got = stored_weights([n for n, _ in layer], ckpt, buffers, fmt)
        for (n, a), g in zip(layer, got, strict=True):
            with np.errstate(over="ignore"):
                want = a.astype(np.float32).astype(low).astype(np.float32)
            assert g.dtype == np.float32
            assert np.array_equal(np.asarray(g).view(np.uint32), want.view(np.uint32)), n


def test_a_layer_whose_program_needs_too_many_temporaries_runs_op_by_op(monkeypatch):
    """`Compiled` runs a layer kind's program when XLA's memory plan keeps its temporaries
    under TEMP_BYTES, else the layer op by op (its results called on concrete arrays); the
    same results either way, and the choice made once per kind and shapes."""
    from codegen.check.layer_buffers import Compiled

    seen = []

    class Slot:
        def results(self, arrays):
            seen.append(isinstance(arrays[0], jax.core.Tracer))
            x, w = arrays
            return [jax.numpy.tanh(x @ w) @ w.T], [("made", 0)], "tree"

    rng = np.random.default_rng(0)
    x, w = (jax.numpy.asarray(rng.standard_normal(s), np.float32) for s in ((64, 256), (256, 512)))
    want = np.tanh(np.asarray(x, np.float64) @ np.asarray(w)) @ np.asarray(w).T
    for budget, traced in ((1 << 30, True), (0, False)):
        monkeypatch.setattr(Compiled, "TEMP_BYTES", budget)
        compiled, seen[:] = Compiled(), []
        for _ in range(2):
            (got,), out_map, tree = compiled.results("kind", Slot(), [x, w])
            np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-4)
            assert (out_map, tree) == ([("made", 0)], "tree")
        assert seen == ([True] if traced else [True, False, False]), (budget, seen)
