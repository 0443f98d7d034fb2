"""MXFP6 matmul weights, as QAIC's `-mxfp6-matmul` stores them: what a weight becomes.

OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project, September 2023):
blocks of k = 32 elements share one E8M0 scale (§5.1); the elements are FP6, E2M3 (bias 1,
largest 7.5, no inf or NaN) or E3M2 (bias 3, largest 28) (§5.3.2); conversion (§6.3): X =
2^(floor(log2(max|V_i|)) − emax_elem) with emax_elem = 2 (E2M3) or 4 (E3M2), P_i = V_i / X
rounded to the element format, clamped to its largest normal.

What Qualcomm does not publish, chosen here: the element format (default E2M3: a weight block of
32 spans a narrow range, and E2M3's third mantissa bit halves the rounding error of E3M2, whose
wider exponent only serves ranges a block does not hold — the MX paper's direct-cast inference
results favour it too; `element="e3m2"` is the other), rounding to nearest with ties to even
(§6.3 leaves it to the implementation), blocks along the matmul's reduction axis, which is the
last axis of every `ref` weight ([out, in] linears, [E, 2I, D] and [E, D, I] experts), a last
block shorter than 32 as if zero-padded, an all-zero block decoding to zeros. Values below
2^-126 read as 0 (XLA:CPU flushes float32 subnormals).
"""

import jax
import jax.numpy as jnp

BLOCK = 32
# element format: (mantissa bits, least normal exponent, largest value, emax_elem)
ELEMENTS = {"e2m3": (3, 0, 7.5, 2), "e3m2": (2, -2, 28.0, 4)}
DEFAULT_ELEMENT = "e2m3"
SCALE_MIN, SCALE_MAX = -127, 127  # E8M0's exponents


def element_name(name):
    """The element format's name, checked; ValueError naming the choices."""
    if name not in ELEMENTS:
        raise ValueError(f"MXFP6 element {name!r}: expected one of {', '.join(ELEMENTS)}")
    return name


def _floor_log2(a):
    """floor(log2 a) of positive float32 values: [...] → int32."""
    _, e = jnp.frexp(a)
    return e.astype(jnp.int32) - 1


def _to_element(y, element):
    """Each value rounded to the FP6 element format (nearest even, clamped to ± its largest).
    y: float32 [...] → float32 [...]."""
    mantissa, emin, largest, _ = ELEMENTS[element]
    a = jnp.abs(y)
    e = jnp.maximum(_floor_log2(jnp.where(a > 0, a, 1.0)), emin)
    step = jnp.ldexp(jnp.ones_like(a), e - mantissa)
    q = jnp.round(a / step) * step  # jnp.round: ties to even
    return jnp.sign(y) * jnp.minimum(q, largest)


def round_trip(x, element=DEFAULT_ELEMENT):
    """x stored as MXFP6 blocks of 32 along its last axis and read back, in x's dtype.
    x: [..., n] float → [..., n]."""
    element = element_name(element)
    n = x.shape[-1]
    pad = -n % BLOCK
    v = jnp.pad(jnp.asarray(x, jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    v = v.reshape(*v.shape[:-1], (n + pad) // BLOCK, BLOCK)
    top = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
    shared = _floor_log2(jnp.where(top > 0, top, 1.0)) - ELEMENTS[element][3]
    shared = jnp.clip(shared, SCALE_MIN, SCALE_MAX)
    scale = jnp.ldexp(jnp.ones_like(top), shared)
    out = _to_element(v / scale, element) * scale
    return out.reshape(*out.shape[:-2], -1)[..., :n].astype(x.dtype)


def is_matmul_weight(path):
    """Whether a parameter (its checkpoint name split on ".") is a matmul operand the compiler
    stores in MXFP6: a linear's `weight`, a router's `proj.weight`, the experts' `gate_up_proj`
    and `down_proj`; not the embedding tables (gathered, not multiplied), norms, scalars or
    the vision position table."""
    leaf = path[-1]
    if leaf in ("gate_up_proj", "down_proj"):
        return True
    return leaf == "weight" and not any(
        p in ("embed_tokens", "embed_tokens_per_layer") or "norm" in p for p in path
    )


def matmul_weights(params, element=DEFAULT_ELEMENT):
    """A parameter tree with every matmul weight of ≥ 2 dims as MXFP6 stores it
    (`is_matmul_weight`); the other leaves unchanged."""
    element = element_name(element)

    def one(path, leaf):
        names = tuple(str(getattr(k, "key", k)) for k in path)
        if jnp.ndim(leaf) >= 2 and is_matmul_weight(names):
            return round_trip(jnp.asarray(leaf), element)
        return leaf

    return jax.tree_util.tree_map_with_path(one, params)
