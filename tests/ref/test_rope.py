"""RoPE against a channel-by-channel numpy oracle (float64 angles, float32 tolerance)."""

import numpy as np
import pytest

from ref.gemma4.text_config import Rope
from ref.rope import apply_rope, axial_inv_freq, axial_rope, rope_inv_freq, rotate_half_split


def rotate_oracle(x, angles):
    """Channel i pairs with i + D/2: (a, b) → (a cos − b sin, b cos + a sin)."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for i in range(half):
        cos, sin = np.cos(angles[..., i]), np.sin(angles[..., i])
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * cos - b * sin
        out[..., i + half] = b * cos + a * sin
    return out


def test_rotate_half_split_against_the_oracle():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 2, 6)).astype(np.float32)
    angles = rng.uniform(-4, 4, size=(3, 1, 3))
    got = np.asarray(rotate_half_split(x, angles))
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.abs(got - rotate_oracle(x, angles)).max() <= 1e-6
    x64 = x.astype(np.float64)
    assert np.asarray(rotate_half_split(x64, angles)).dtype == np.float64


def test_axial_inv_freq_exact_formula():
    for head_dim, theta in ((16, 100.0), (24, 37.0)):
        spatial = head_dim // 2
        want = [1 / theta ** (i / spatial) for i in range(0, spatial, 2)]
        got = np.asarray(axial_inv_freq(head_dim, theta))
        assert got.dtype == np.float32 and len(got) == head_dim // 4
        assert np.abs(got - want).max() <= 1e-7


def test_axial_rope_rotates_halves_by_column_and_row():
    rng = np.random.default_rng(1)
    n, h, d, theta = 5, 2, 8, 100.0
    x = rng.normal(size=(n, h, d)).astype(np.float32)
    positions = np.array([[0, 0], [1, 0], [0, 3], [2, 5], [7, 1]])
    inv = np.array([1 / theta ** (i / (d // 2)) for i in range(0, d // 2, 2)])
    want = np.concatenate(
        [
            rotate_oracle(x[..., : d // 2], (positions[:, 0:1, None] * inv)),
            rotate_oracle(x[..., d // 2 :], (positions[:, 1:2, None] * inv)),
        ],
        axis=-1,
    )
    got = np.asarray(axial_rope(x, positions, theta))
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.abs(got - want).max() <= 2e-6
    assert (got[0] == x[0]).all()  # position (0, 0): identity
    with pytest.raises(ValueError, match="axial RoPE needs head_dim divisible by 4, got 6"):
        axial_rope(x[..., :6], positions, theta)


@pytest.mark.parametrize(
    ("rope", "head_dim", "want"),
    [
        (Rope("default", 10_000.0), 8, [1, 10_000**-0.25, 10_000**-0.5, 10_000**-0.75]),
        # Proportional: int(0.5 · 8 // 2) = 2 rotated pairs spaced over all 8 channels, / factor.
        (
            Rope("proportional", 10_000.0, partial_rotary_factor=0.5, factor=4.0),
            8,
            [1 / 4, 10_000**-0.25 / 4, 0, 0],
        ),
        (
            Rope("proportional", 100.0, partial_rotary_factor=0.25, factor=1.0),
            16,
            [1, 100**-0.125, 0, 0, 0, 0, 0, 0],
        ),
        (Rope("proportional", 100.0), 4, [1, 0.1]),
    ],
)
def test_rope_inv_freq_exact(rope, head_dim, want):
    got = rope_inv_freq(rope, head_dim)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    assert np.abs(got - np.asarray(want)).max() <= 1e-7 * max(want)
    assert (got[np.asarray(want) == 0] == 0).all()


def test_apply_rope_against_the_oracle():
    rng = np.random.default_rng(2)
    b, s, h, d = 2, 3, 2, 8
    x = rng.normal(size=(b, s, h, d)).astype(np.float32)
    positions = np.array([[0, 1, 2], [5, 9, 40]])
    inv = np.array([1.0, 0.3, 0.01, 0.0], np.float32)
    want = rotate_oracle(x, positions[:, :, None, None] * inv.astype(np.float64))
    got = np.asarray(apply_rope(x, positions, inv))
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.abs(got - want).max() <= 1e-5
    assert (got[0, 0] == x[0, 0]).all()
    assert (got[..., 3] == x[..., 3]).all() and (got[..., 7] == x[..., 7]).all()  # frequency 0


def test_angles_are_float32_products_as_in_transformers():
    """transformers multiplies positions by inv_freq in float32; at large positions the float32
    product is off the exact angle by ~1e-4 rad, so the rotation must use that product."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(1, 3, 1, 4)).astype(np.float32)
    positions = np.array([[3001, 7919, 9973]])
    inv = np.array([0.3, 0.0123], np.float32)
    angles32 = positions[:, :, None, None].astype(np.float32) * inv  # float32 products
    assert np.abs(angles32 - positions[:, :, None, None] * inv.astype(np.float64)).max() > 1e-4
    got = np.asarray(apply_rope(x, positions, inv))
    assert np.abs(got - rotate_oracle(x, angles32.astype(np.float64))).max() <= 5e-6
    n_pos = np.array([[3001, 7919], [9973, 5]])
    xa = rng.normal(size=(2, 1, 8)).astype(np.float32)
    inv_a = np.asarray(axial_inv_freq(8, 0.7))  # checked above against the formula
    angles_a = n_pos.astype(np.float32)[:, :, None] * inv_a  # [N, 2, D/4] float32
    want = np.concatenate(
        [
            rotate_oracle(xa[..., :4], angles_a[:, None, 0].astype(np.float64)),
            rotate_oracle(xa[..., 4:], angles_a[:, None, 1].astype(np.float64)),
        ],
        axis=-1,
    )
    assert np.abs(np.asarray(axial_rope(xa, n_pos, 0.7)) - want).max() <= 5e-6


def test_default_rope_ignores_the_proportional_fields():
    """Default RoPE rotates every pair and has no linear scaling: factor and
    partial_rotary_factor belong to the proportional kind."""
    plain = rope_inv_freq(Rope("default", 10_000.0), 8)
    scaled = rope_inv_freq(Rope("default", 10_000.0, factor=4.0), 8)
    assert (scaled == plain).all()
