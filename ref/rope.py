"""Rotary position embeddings: half-split rotation, Gemma 4's 2D axial variant (vision) and
its text RoPE kinds (default and proportional)."""

import jax.numpy as jnp
import numpy as np


def rotate_half_split(x, angles):
    """Half-split (not interleaved) RoPE: channel i pairs with i + D/2.

    x: [..., D]; angles: [..., D/2], broadcastable against x's leading dims → [..., D].
    """
    cos = jnp.cos(angles).astype(x.dtype)
    sin = jnp.sin(angles).astype(x.dtype)
    cos = jnp.concatenate([cos, cos], axis=-1)
    sin = jnp.concatenate([sin, sin], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def axial_inv_freq(head_dim, theta):
    """Inverse frequencies of one axis: `1/θ^(arange(0, hd/2, 2)/(hd/2))` → [hd/4] float32."""
    spatial = head_dim // 2
    return 1.0 / (theta ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))


def axial_rope(x, positions, theta):
    """2D axial RoPE: the first D/2 channels rotate by x (column), the last D/2 by y (row).

    x: [N, H, D] with D % 4 == 0; positions: [N, 2] integer (x, y) → [N, H, D].
    """
    head_dim = x.shape[-1]
    if head_dim % 4:
        raise ValueError(f"axial RoPE needs head_dim divisible by 4, got {head_dim}")
    inv = axial_inv_freq(head_dim, theta)
    angles = positions.astype(jnp.float32)[:, :, None] * inv  # [N, 2, D/4]
    half = head_dim // 2
    first = rotate_half_split(x[..., :half], angles[:, None, 0, :])
    second = rotate_half_split(x[..., half:], angles[:, None, 1, :])
    return jnp.concatenate([first, second], axis=-1)


def rope_inv_freq(rope, head_dim):
    """Inverse frequencies [head_dim/2] float32 (transformers' default / proportional RoPE).

    Proportional RoPE rotates only the first `partial_rotary_factor · head_dim/2` pairs, with
    frequencies still spaced over the whole head_dim; the rest get frequency 0 (no rotation).
    """
    if rope.kind == "default":
        exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
        return (1.0 / np.float32(rope.theta) ** exponent).astype(np.float32)
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    exponent = np.arange(0, 2 * angles, 2, dtype=np.float32) / np.float32(head_dim)
    rotated = 1.0 / np.float32(rope.theta) ** exponent
    inv = np.concatenate([rotated, np.zeros(head_dim // 2 - angles, np.float32)])
    return (inv / np.float32(rope.factor)).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """x: [B, S, H, D]; positions: [B, S] int; inv_freq: [D/2] → [B, S, H, D]."""
    angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq)
    return rotate_half_split(x, angles)
