"""`ref.probe_jit`: the device model compiled gives `numerics.probe`'s values and Records, with
statistics numpy computes from the rounded values, and compiled programs are shared only by
equal programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref import numerics, probe_jit
from tests.util import examples

ROWS, WIDTH, OUT = 64, 64, 1024  # the weight and the scores hold ≥ probe_jit.LARGE values


def _attend(x, w, keep_mask):
    """A linear with a transposed [OUT, WIDTH] weight, scores masked with −inf, a softmax and
    a second matmul: x [ROWS, WIDTH], w [OUT, WIDTH], keep_mask [ROWS, OUT] bool → [ROWS,
    WIDTH]."""
    scores = jnp.where(keep_mask, x @ w.T, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1) @ w


def _f16(a):
    with np.errstate(over="ignore"):
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _drawn(seed, scale, special):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((ROWS, WIDTH)) * scale).astype(np.float32)
    w = rng.standard_normal((OUT, WIDTH)).astype(np.float32)
    mask = rng.random((ROWS, OUT)) < 0.7
    mask[:, 0] = True
    if special is not None:
        x[rng.integers(ROWS), rng.integers(WIDTH)] = special
    return x, w, mask


@settings(max_examples=examples(12), deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([1.0, 30.0, 3000.0]),
    st.sampled_from([None, np.inf, -np.inf, np.nan, 7e4]),
    st.booleans(),
)
def test_compiled_probe_gives_the_op_by_op_values_and_records(seed, scale, special, keep):
    """`probe_jit` against `numerics.probe` on drawn activations (overflowing ones, an inf, a
    NaN, a value beyond float16 among them) with a transposed weight and a −inf mask: the
    same result bit for bit and the same Records (names, ordinals, kept, peaks, first
    non-finite), with and without a plan keeping the scores in float32. Oracle for the
    statistics: numpy on the rounded first matmul (float32 of the rounded operands, rounded),
    within one float16 step where XLA's and numpy's accumulation orders part."""
    x, w, mask = _drawn(seed, scale, special)
    plan = {":dot_general#0"} if keep else ()
    want, expected = numerics.probe(_attend, "fp16", x, w, mask, keep=plan)
    got, records = probe_jit.probe_jit(_attend, "fp16", x, w, mask, keep=plan)
    assert np.array_equal(np.asarray(got), np.asarray(want), equal_nan=True)
    assert records == expected
    first = records[1]  # the transpose is records[0], then the scores' matmul
    assert (first.primitive, first.kept) == ("dot_general", keep)
    assert records[0].max_abs == np.abs(_f16(w)).max()
    scores = _f16(x) @ _f16(w).T
    scores = scores if keep else _f16(scores)
    finite = np.isfinite(scores)
    peak = np.abs(scores[finite]).max() if finite.any() else 0.0
    assert abs(first.max_abs - peak) <= 2.0**-10 * peak
    nan_in = special is not None and np.isnan(special)
    assert first.nonfinite == (nan_in or (not finite.all() and np.isfinite(_f16(x)).all()))


@settings(max_examples=examples(6), deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1.0, 3e4, 1e5]))
def test_stored_weights_are_read_as_given(seed, scale):
    """A weight rounded on the host (numpy: the oracle, independent of `round_to`) and given
    as `stored`: the compiled device model reads it as it is, with the values and Records of
    rounding it in the program (scaled past float16's range, some of its values are inf);
    and `stored` does skip the rounding: an unrounded weight given so changes the result."""
    x, drawn, mask = _drawn(seed, 1.0, None)
    w = drawn * np.float32(scale)
    want, expected = probe_jit.probe_jit(_attend, "fp16", x, w, mask)
    got, records = probe_jit.probe_jit(_attend, "fp16", x, _f16(w), mask, stored={1})
    assert np.array_equal(np.asarray(got), np.asarray(want), equal_nan=True)
    assert records == expected
    raw, _ = probe_jit.probe_jit(_attend, "fp16", x, drawn, mask, stored={1})
    rounded, _ = probe_jit.probe_jit(_attend, "fp16", x, drawn, mask)
    assert not np.array_equal(np.asarray(raw), np.asarray(rounded))


def test_stored_indexes_arrays_only():
    """`stored` names args by index: refused when an arg is a tree of several arrays."""
    x, w, _ = _drawn(0, 1.0, None)
    with pytest.raises(ValueError, match=r"stored=\[1\] indexes args"):
        probe_jit.probe_jit(lambda x, p: x @ p["w"].T, "fp16", x, {"w": w, "b": w}, stored={1})


def test_programs_are_shared_only_when_equal():
    """Two functions of one structure whose constants differ, and one function under two
    plans: each result is its own (the cache key holds the program's constants and its text)."""
    x, _, _ = _drawn(0, 1.0, None)
    for c in (2.0, 3.0):
        row = np.full(WIDTH, c, np.float32)

        def scaled(x, row=row):
            return x * row

        def literal(x, c=c):
            return x * c

        for fn in (scaled, literal):
            got, _ = probe_jit.probe_jit(fn, "fp16", x)
            assert np.array_equal(np.asarray(got), _f16(_f16(x) * c))

    def widened(x):
        return x * 1000.0 / 1000.0

    big = np.full(WIDTH, 100.0, np.float32)
    plain, records = probe_jit.probe_jit(widened, "fp16", big)
    kept, _ = probe_jit.probe_jit(widened, "fp16", big, keep={records[0].key})
    assert np.isinf(np.asarray(plain)).all() and np.array_equal(np.asarray(kept), big)


def _scoped(scope):
    """x ↦ (x·1000)·1000 − x under jax.named_scope(scope): module path `scope`."""

    def fn(x):
        with jax.named_scope(scope):
            return x * 1000.0 * 1000.0 - x

    return fn


def test_a_function_traced_before_is_named_anew_without_a_new_trace():
    """Calls of one traced function under other prefixes, and of an equal one under another
    name stack, give `numerics.probe`'s Records (names, ordinals, kept) and values; the
    device program is traced again only for a new name stack, and once more for the first
    plan that keeps one of its tensors: every such plan runs that program, its flags as data;
    a plan that keeps none of them runs the program of no plan (the first call's names
    reused, or one plan's flags read under another, would fail)."""
    x = np.full((3, WIDTH), 2.0, np.float32)
    before, keys = len(probe_jit._TRACED), set(probe_jit._TRACED)
    calls = [(_scoped("a"), "", ()), (_scoped("a"), "layers.1", ()),
             (_scoped("b"), "layers.1", ()), (_scoped("b"), "layers.2", ()),
             (_scoped("b"), "layers.2", ("layers.2.b:mul#0",)),
             (_scoped("b"), "layers.3", ("layers.2.b:mul#0",)),
             (_scoped("b"), "layers.3", ("layers.3.b:mul#1",)),
             (_scoped("b"), "layers.3", ("layers.3.b:mul#0", "layers.3.b:mul#1"))]  # fmt: skip
    traced = []
    for fn, prefix, keep in calls:
        got, records = probe_jit.probe_jit(fn, "fp16", x, prefix=prefix, keep=keep)
        want, expected = numerics.probe(fn, "fp16", x, prefix=prefix, keep=keep)
        assert records == expected, (prefix, keep, records)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        traced.append(len(probe_jit._TRACED) - before)
    # new keys: a, b; b's programs: no plan (also layers.3 under a plan keeping a layers.2
    # tensor), and the plan as data (mul#0, mul#1, both)
    assert traced == [1, 1, 2, 2, 2, 2, 2, 2], traced
    programs = [len(v[1]) for k, v in probe_jit._TRACED.items() if k not in keys]
    assert programs == [1, 2], programs
    # a plan search's later call keeping none of b's tensors runs b's plain program (the
    # plan as data is a select per tensor: twice the memory of an E4B vision layer's)
    (key,) = [k for k, v in probe_jit._TRACED.items() if k not in keys and len(v[1]) == 2]
    ran = []
    for flag, program in list(probe_jit._TRACED[key][1].items()):
        probe_jit._TRACED[key][1][flag] = lambda *a, f=flag, p=program: ran.append(f) or p(*a)
    probe_jit.probe_jit(_scoped("b"), "fp16", x, prefix="layers.4", keep=calls[-1][2])
    probe_jit.probe_jit(_scoped("b"), "fp16", x, prefix="layers.3", keep=calls[-1][2])
    assert ran == [False, True], ran


@settings(max_examples=examples(10), deadline=None)
@given(st.permutations(range(4)), st.integers(0, 2**32 - 1))
def test_a_transpose_read_by_a_matmul_is_folded_into_it_with_the_same_values(stored, seed):
    """A batched matmul reading a transposed [B, K, N1, N2] operand, stored in a drawn
    dimension order: traced through `numerics.emulate` (float32: nothing rounded), the
    transpose is folded into the matmul where its two free dimensions keep their order, and
    the result is jnp's within float32 rounding. Oracle: numpy's einsum."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 5)).astype(np.float32)
    w = rng.standard_normal((2, 5, 4, 6)).astype(np.float32)
    kept = np.transpose(w, stored)
    back = tuple(int(i) for i in np.argsort(stored))

    def fn(x, kept):
        operand = jnp.transpose(kept, back)
        return jax.lax.dot_general(x, operand, (((2,), (1,)), ((0,), (0,))))

    jaxpr = jax.make_jaxpr(jax.jit(numerics.emulate(fn, "float32")))(x, kept)
    dots = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "dot_general"]
    free = [stored.index(2), stored.index(3)]
    assert (dots[0].invars[1].aval.shape == kept.shape) == (free == sorted(free))
    got = jax.jit(numerics.emulate(fn, "float32"))(x, kept)
    want = np.einsum("bmk,bkpq->bmpq", x, w)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@jax.jit
def _thousandth(a):
    """A body of its own (a `pjit` equation): a / 1000."""
    return a / 1000.0


def _kept_then_read(x):
    """y = x·1000, read inside a jitted body (y / 1000) and through a reshape (then / 1000)."""
    y = x * 1000.0
    return _thousandth(y), y.reshape(-1) / 1000.0


@settings(max_examples=examples(5), deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_a_kept_tensor_stays_float32_in_a_body_and_a_move_of_it_is_rounded(seed, width):
    """A tensor a plan keeps is read in float32 inside a body it is passed to (a jitted
    function: the device graph has no such boundary), and a move of it (a reshape, not kept)
    is stored rounded, as in the device graph (`device_graph.moves`); in `emulate`, `probe`
    and `probe_jit` alike. Oracle: numpy, step by step, x·1000 past float16's range."""
    x = np.random.default_rng(seed).uniform(70.0, 500.0, (2, width)).astype(np.float32)
    keep = {":mul#0"}  # x·1000: the first mul outside any module
    y = _f16(x) * np.float32(1000.0)  # kept: float32 product of the rounded x
    want = (_f16(y / np.float32(1000.0)), _f16(_f16(y).reshape(-1) / np.float32(1000.0)))
    assert np.isinf(want[1]).all() and np.isfinite(want[0]).all()
    runs = {
        "emulate": numerics.emulate(_kept_then_read, "fp16", keep=keep)(x),
        "probe": numerics.probe(_kept_then_read, "fp16", x, keep=keep)[0],
        "probe_jit": probe_jit.probe_jit(_kept_then_read, "fp16", x, keep=keep)[0],
    }
    for name, got in runs.items():
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)


@settings(max_examples=examples(10), deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["fp16", "bf16"]), st.integers(1, 4096))
def test_small_arrays_round_in_numpy_as_xla_rounds_them(seed, precision, n):
    """`numerics._rounded` (numpy, for a concrete array of fewer than SMALL values) equals
    `round_to` (XLA) bit for bit on float32 bit patterns of every kind: normal, subnormal,
    past the format's range, ±inf and NaN."""
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits[: min(n, 4)] = [0x7F800000, 0x00000001, 0x477FF000, 0x7FC00000][: min(n, 4)]
    x = bits.view(np.float32)
    got = numerics._rounded(x, precision)
    want = np.asarray(numerics.round_to(x, precision))
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    nan = np.isnan(got) & np.isnan(want)
    assert (nan | (got.view(np.uint32) == want.view(np.uint32))).all()
