"""The KV cache stored as MXINT8 (`ref.numerics.store`): encode, decode, round trip.

MXINT8 follows the OCP Microscaling Formats (MX) Specification v1.0 (Open Compute Project,
September 2023), §5 (MXINT8: block of k = 32, scale E8M0, elements INT8: two's complement
with an implicit scale of 2^-6, so element values m·2^-6, |m| ≤ 127 here) and §6.3 (the
conversion from float: X = 2^(floor(log2(max|V_i|)) − emax_elem) with emax_elem = 0 for
INT8, P_i = V_i / X quantized to the element format, clamped to its largest magnitude).
Choices the spec leaves to the implementation, made here: rounding to nearest, ties to even;
the symmetric element range ±127 (−128 never produced); an all-zero block takes the smallest
scale 2^-127; blocks run along the last axis (a KV cache's head_dim), a last block shorter
than 32 behaves as if zero-padded (zeros change no block maximum). A non-finite value makes
its block's scale NaN (E8M0 0xFF) and the block decodes to NaN; `mxint8_encode` on concrete
arrays refuses it. Which axis QAIC blocks its MXINT8 retained state along is not documented.
"""

import jax
import jax.numpy as jnp
import numpy as np

MX_BLOCK = 32  # elements sharing one scale (MX spec §5, k = 32)
MX_FRACTION_BITS = 6  # INT8 element value = m · 2^-6 (MX spec §5.3)
MX_INT_MAX = 127  # largest element magnitude kept (symmetric range)
E8M0_BIAS = 127  # E8M0 scale: 2^(bits − 127), bits 0 … 254; 255 = NaN
E8M0_NAN = 255
SCALE_EMIN, SCALE_EMAX = -127, 127


def _blocks(x):
    """x [..., n] → float32 [..., ceil(n/32), 32], zero-padded."""
    n = x.shape[-1]
    pad = -n % MX_BLOCK
    x = jnp.pad(jnp.asarray(x, jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], (n + pad) // MX_BLOCK, MX_BLOCK)


def mxint8_encode(x):
    """MXINT8 blocks of x along its last axis (see the module docstring for the spec).

    x: [..., n] float → (scales [..., ceil(n/32)] uint8 (E8M0 bits), elements
    [..., ceil(n/32), 32] int8). Concrete non-finite input is refused (ValueError naming the
    first such index); traced input gives that block the NaN scale.
    """
    if not isinstance(x, jax.core.Tracer):
        bad = ~np.isfinite(np.asarray(x, np.float32))
        if bad.any():
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
            raise ValueError(
                f"mxint8_encode: x{list(at)} = {np.asarray(x)[at]}: expected finite values "
                "(MXINT8 has no infinity; a NaN would poison its whole block of 32)"
            )
    # integer arithmetic on the bits: XLA:CPU flushes float32 subnormals to zero in float ops
    bits = jax.lax.bitcast_convert_type(_blocks(x), jnp.int32)
    magnitude = bits & 0x7FFFFFFF  # ordered as |x| for finite values
    field = magnitude >> 23
    significand = jnp.where(field > 0, (magnitude & 0x7FFFFF) | 0x800000, magnitude)
    power = jnp.maximum(field, 1) - 150  # |x| = significand · 2^power
    top = jnp.max(magnitude, axis=-1)
    top_field = top >> 23
    # floor(log2(max |x|)): the top set bit of the largest value
    exponent = (
        jnp.maximum(top_field, 1)
        - 150
        + 31
        - jax.lax.clz(jnp.where(top_field > 0, (top & 0x7FFFFF) | 0x800000, top))
    )
    shared = jnp.clip(jnp.where(top > 0, exponent, SCALE_EMIN), SCALE_EMIN, SCALE_EMAX)
    shift = power + MX_FRACTION_BITS - shared[..., None]  # element = significand · 2^shift
    up = jnp.left_shift(significand, jnp.clip(shift, 0, 7))
    k = jnp.clip(-shift, 1, 30)
    q, rem, half = significand >> k, significand & ((1 << k) - 1), 1 << (k - 1)
    down = q + ((rem > half) | ((rem == half) & (q & 1 == 1)))  # ties to even
    elements = jnp.minimum(jnp.where(shift >= 0, up, down), MX_INT_MAX)
    elements = jnp.where(bits < 0, -elements, elements)
    finite = top < 0x7F800000
    scales = jnp.where(finite, shared + E8M0_BIAS, E8M0_NAN).astype(jnp.uint8)
    return scales, jnp.where(finite[..., None], elements, 0).astype(jnp.int8)


def mxint8_decode(scales, elements, n):
    """Values of MXINT8 blocks: scales [..., b] uint8, elements [..., b, 32] int8 → float32
    [..., n] (the first n of b·32); a block with the NaN scale is NaN. A value below
    float32's normal range (2^-126) reads as 0, as XLA:CPU flushes float32 subnormals."""
    shared = scales.astype(jnp.int32) - E8M0_BIAS
    values = jnp.ldexp(elements.astype(jnp.float32), (shared - MX_FRACTION_BITS)[..., None])
    values = jnp.where((scales == E8M0_NAN)[..., None], jnp.nan, values)
    return values.reshape(*values.shape[:-2], -1)[..., :n]


def mxint8_round_trip(x):
    """x stored as MXINT8 and read back, in x's dtype. x: [..., n] → [..., n]."""
    return mxint8_decode(*mxint8_encode(x), x.shape[-1]).astype(x.dtype)
