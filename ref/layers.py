"""Small layers shared by the Gemma 4 vision tower and text model: pure functions, and the
Linen modules that give them the checkpoint's parameter names (`weight`).

Weights keep the Hugging Face `[out, in]` layout so a checkpoint loads without transposes.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp


def rms_norm(x, weight=None, eps=1e-6):
    """Gemma 4 RMSNorm in (at least) float32: `x · (mean(x²) + eps)^-0.5 · w` (no `1 + w`).

    x: [..., D]; weight: [D] or None (no scale). Returns x's dtype.
    """
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    # rsqrt, not power(·, -0.5): jax2onnx 0.17.1's Pow cannot trace a symbolic batch axis.
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight is not None:
        normed = normed * weight.astype(acc)
    return normed.astype(x.dtype)


def linear(x, weight):
    """Bias-free linear with an HF weight. x: [..., in]; weight: [out, in] → [..., out]."""
    return jnp.matmul(x, weight.astype(x.dtype).T)


def clipped_linear(x, weight, bounds=None):
    """Clamp input, linear, clamp output (Gemma4ClippableLinear).

    x: [..., in]; weight: [out, in]; bounds: None (unclipped) or
    `(input_min, input_max, output_min, output_max)` scalars → [..., out].
    """
    if bounds is None:
        return linear(x, weight)
    in_min, in_max, out_min, out_max = (jnp.asarray(b, x.dtype) for b in bounds)
    y = linear(jnp.clip(x, in_min, in_max), weight)
    return jnp.clip(y, out_min, out_max)


def gelu_tanh(x):
    """GELU with the tanh approximation (`gelu_pytorch_tanh`); exact erf differs by ~1e-4."""
    return jax.nn.gelu(x, approximate=True)


def gated_mlp(x, gate, up, down):
    """`down(gelu_tanh(gate(x)) · up(x))`; gate/up/down are callables [..., a] → [..., b]."""
    return down(gelu_tanh(gate(x)) * up(x))


class Weight(nn.Module):
    """A `weight` parameter of the given shape (HF linears: [out, in])."""

    shape: tuple

    @nn.compact
    def __call__(self):
        return self.param("weight", nn.initializers.lecun_normal(), self.shape)


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm; `with_scale=False` has no parameter (v_norm, embed_vision)."""

    eps: float
    with_scale: bool = True

    @nn.compact
    def __call__(self, x):
        w = None
        if self.with_scale:
            w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        return rms_norm(x, w, self.eps)


class Embedding(nn.Module):
    """Gemma4TextScaledWordEmbedding: `weight[ids] · scale`. ids: [...] → [..., dim]."""

    num: int
    dim: int
    scale: float

    @nn.compact
    def __call__(self, ids):
        w = self.param("weight", nn.initializers.normal(0.02), (self.num, self.dim))
        return w[ids] * jnp.asarray(self.scale, w.dtype)
