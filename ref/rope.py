"""Rotary position embeddings: half-split rotation and Gemma 4's 2D axial variant."""

import jax.numpy as jnp


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
