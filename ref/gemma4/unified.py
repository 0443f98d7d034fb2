"""Gemma 4 12B Unified's embedders: no vision or audio tower, pixels and samples projected
straight into the text stream (transformers' Gemma4UnifiedVisionEmbedder and
Gemma4UnifiedMultimodalEmbedder), parameters named as in the checkpoint under
`model.vision_embedder` (the patch norms, dense and position table), `model.embed_vision`
(the last projection) and `model.embed_audio`.

Vision, per soft token (a (p·k)² × 3 block of pixels in [0, 1], no mean or std):
LayerNorm → Linear (bias) → LayerNorm → + table[x, 0] + table[y, 1] → LayerNorm → RMSNorm
without scale → Linear (no bias) to the text width. x is the block's column and y its row in
its own image (restarting at 0 per item). Every step is per token, so items of any size are
packed one after another with no padding: transformers' padding blocks (position (−1, −1),
no table row) are dropped before the scatter and never exist here.

Audio, per soft token (640 samples, a frame of the zero-padded waveform): RMSNorm without
scale → Linear (no bias) to the text width (`Projection`, `embed_audio` itself).

LayerNorm is torch's (eps 1e-5, biased variance), every norm computed in float32.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from ref.gemma4.audio import Dense
from ref.layers import Weight, linear, rms_norm

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which Gemma4UnifiedVisionEmbedder keeps


def layer_norm(x, weight, bias, eps=LAYER_NORM_EPS):
    """torch's LayerNorm in (at least) float32: `(x − mean) / √(var + eps) · w + b`.

    x: [..., D]; weight, bias: [D] → x's dtype."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    out = centred * jax.lax.rsqrt(var + eps) * weight.astype(acc) + bias.astype(acc)
    return out.astype(x.dtype)


class LayerNorm(nn.Module):
    """A LayerNorm's `weight` and `bias` (torch.nn.LayerNorm)."""

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        w = self.param("weight", nn.initializers.ones, (d,))
        b = self.param("bias", nn.initializers.zeros, (d,))
        return layer_norm(x, w, b)


class Projection(nn.Module):
    """Gemma4UnifiedMultimodalEmbedder: RMSNorm without scale, `embedding_projection` (no
    bias). x: [N, D] → [N, text_hidden]."""

    text_hidden_size: int
    eps: float

    @nn.compact
    def __call__(self, x):
        w = Weight((self.text_hidden_size, x.shape[-1]), name="embedding_projection")()
        return linear(rms_norm(x, None, self.eps), w)


def position_embedding(table, positions):
    """table [P, 2, D], positions [N, 2] as (x, y) → [N, D]: table[x, 0] + table[y, 1]."""
    x = jnp.take(table[:, 0], positions[:, 0], axis=0)
    return x + jnp.take(table[:, 1], positions[:, 1], axis=0)


class PatchEmbedder(nn.Module):
    """`vision_embedder`: patches [N, (p·k)²·3], positions [N, 2] → [N, mm_embed_dim] (the
    position-normed blocks). config: UnifiedVisionConfig."""

    config: object

    @nn.compact
    def __call__(self, patches, positions):
        c = self.config
        x = LayerNorm(name="patch_ln1")(patches)
        x = Dense(c.mm_embed_dim, name="patch_dense")(x)
        x = LayerNorm(name="patch_ln2")(x)
        table = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (c.mm_posemb_size, 2, c.mm_embed_dim)
        )
        x = x + position_embedding(table, positions).astype(x.dtype)
        return LayerNorm(name="pos_norm")(x)


class VisionEmbedder(nn.Module):
    """The vision embedder on packed soft tokens: `vision_embedder` then `embed_vision` (the
    checkpoint's two groups; transformers renames them into one module on load).

    patches [N, (p·k)²·3] in [0, 1], positions [N, 2] (x, y) in [0, mm_posemb_size) →
    [N, text_hidden]. config: UnifiedVisionConfig."""

    config: object

    @nn.compact
    def __call__(self, patches, positions):
        c = self.config
        x = PatchEmbedder(c, name="vision_embedder")(patches, positions)
        return Projection(c.text_hidden_size, c.rms_norm_eps, name="embed_vision")(x)


vision_apply = jax.jit(
    lambda params, patches, positions, *, config: VisionEmbedder(config).apply(
        {"params": params}, patches, positions
    ),
    static_argnames=("config",),
)
audio_apply = jax.jit(
    lambda params, frames, *, config: Projection(
        config.text_hidden_size, config.rms_norm_eps
    ).apply({"params": params}, frames),
    static_argnames=("config",),
)
