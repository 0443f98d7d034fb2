"""MXFP6 weights (`ref.mxfp6`) against an independent encoder: ml_dtypes' float6 types (their
own round-to-nearest-even, saturating casts) with a numpy E8M0 block scale, bit for bit."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref import mxfp6
from tests.util import examples

TYPES = {"e2m3": (ml_dtypes.float6_e2m3fn, 2), "e3m2": (ml_dtypes.float6_e3m2fn, 4)}


def oracle(x, element):
    """numpy: per block of 32 along the last axis, X = 2^(floor(log2 max|v|) − emax_elem)
    (frexp in float64), v / X cast to ml_dtypes' float6 and back, times X."""
    dtype, emax = TYPES[element]
    x = np.asarray(x, np.float64)
    n = x.shape[-1]
    v = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % 32)])
    v = v.reshape(*v.shape[:-1], -1, 32)
    top = np.abs(v).max(axis=-1, keepdims=True)
    _, e = np.frexp(np.where(top > 0, top, 1.0))
    scale = np.ldexp(1.0, np.clip(e - 1 - emax, -127, 127))
    out = (v / scale).astype(dtype).astype(np.float64) * scale
    return out.reshape(*out.shape[:-2], -1)[..., :n].astype(np.float32)


@st.composite
def weights(draw):
    """Float32 rows of normal magnitudes over a drawn dynamic range, zeros, ties and blocks
    of one value; the last block short."""
    # a few shapes (each compiles once): one block, a short last block, several blocks
    rows, n = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 32, 33, 70]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.5, 3.0, 12.0]))
    x = rng.normal(size=(rows, n)) * np.exp2(rng.uniform(-spread, spread, (rows, n)))
    x *= np.exp2(draw(st.integers(-60, 60)))
    kind = draw(st.sampled_from(["plain", "zeros", "ties", "constant"]))
    if kind == "zeros":
        x[:, ::3] = 0.0
    elif kind == "ties":  # exact midpoints between FP6 values after the block scale
        x = np.round(x * 16) / 16 + 1 / 32
    elif kind == "constant":
        x[:] = x[0, 0]
    return x.astype(np.float32)


@pytest.mark.parametrize("element", ["e2m3", "e3m2"])
@settings(max_examples=examples(15), deadline=None)
@given(x=weights())
def test_round_trip_equals_ml_dtypes_bit_for_bit(element, x):
    got = np.asarray(mxfp6.round_trip(x, element))
    want = oracle(x, element)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_what_the_format_keeps():
    """A block of largest 7: E2M3 steps by 1/8 below 2, E3M2 by 1/4 (1.125 is a tie there, to
    even); 2^-6 beside a 1 is gone in E2M3 and kept by E3M2's wider exponent."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [1.0, 1.125, 1 / 1024, -7.0]
    e2 = np.asarray(mxfp6.round_trip(x, "e2m3"))[0, :4]
    e3 = np.asarray(mxfp6.round_trip(x, "e3m2"))[0, :4]
    np.testing.assert_array_equal(e2, [1.0, 1.125, 0.0, -7.0])
    np.testing.assert_array_equal(e3, [1.0, 1.0, 0.0, -7.0])
    assert float(np.asarray(mxfp6.round_trip(np.float32([[1.0, 2**-6]]), "e3m2"))[0, 1]) == 2**-6
    assert float(np.asarray(mxfp6.round_trip(np.float32([[1.0, 2**-6]]), "e2m3"))[0, 1]) == 0.0


def test_matmul_weights_are_the_linears_and_experts():
    tree = {
        "embed_tokens": {"weight": np.full((4, 40), 0.3, np.float32)},
        "layers": {
            "0": {
                "q_proj": {"weight": np.full((4, 40), 0.3, np.float32)},
                "input_layernorm": {"weight": np.full((40,), 0.3, np.float32)},
                "experts": {"gate_up_proj": np.full((2, 4, 40), 0.3, np.float32)},
            }
        },
    }
    out = mxfp6.matmul_weights(tree)
    stored = float(np.asarray(mxfp6.round_trip(np.float32([[0.3]])))[0, 0])
    assert stored != np.float32(0.3)
    assert np.asarray(out["layers"]["0"]["q_proj"]["weight"])[0, 0] == stored
    assert np.asarray(out["layers"]["0"]["experts"]["gate_up_proj"])[0, 0, 0] == stored
    assert out["embed_tokens"]["weight"][0, 0] == np.float32(0.3)
    assert out["layers"]["0"]["input_layernorm"]["weight"][0] == np.float32(0.3)
    with pytest.raises(ValueError, match="MXFP6 element 'e4m1': expected one of e2m3, e3m2"):
        mxfp6.round_trip(tree["embed_tokens"]["weight"], "e4m1")
