"""The packed Gemma 4 audio tower (Gemma4AudioModel) and embed_audio as Flax Linen modules.

Module and parameter names are the Hugging Face checkpoint's own (`subsample_conv_projection.
layer0.conv.weight`, `layers.0.self_attn.q_proj.linear.weight`, …), linear weights `[out, in]`,
convolution weights in torch's layout (`[out, in, time, mel]`, depthwise `[D, 1, K]`), so the
subtree of a checkpoint under `model.audio_tower` is `AudioModel`'s params as it is, and
`model.embed_audio` is `EmbedAudio`'s.

The tower runs on packed clips (`ref.gemma4.audio_packing`): frames [N, 128] and the index arrays
that keep clips apart. Per clip, as transformers computes it:

- subsampling: twice (Conv2d k 3, stride 2, pad 1 over (time, mel), no bias → LayerNorm over
  channels without bias → ReLU), mel 128 → 32, then `input_proj_linear` on the (mel, channel)
  values, channel fastest;
- conformer blocks: ½FFN, chunked local attention (`ref.gemma4.audio_attention`), light conv
  (GLU, causal depthwise conv), ½FFN, RMSNorm; the residual stream clamped to
  ±gradient_clipping where transformers clamps it;
- `output_proj` (with bias) to output_proj_dims.

Measured at the released size (random weights, a 30 s and a 7.3 s clip packed in one call):
against transformers 1.1e-5 relative in float32 after 12 layers, growing from 7e-7 after the
subsampling; float32 noise, both sides alike (ours 8.7e-6 and transformers' 7.1e-6 from this
tower in float64). 6.3 s for the 933 soft tokens on a 2-core CPU, transformers 20 s.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ref.gemma4.audio_attention import chunked_attention, gather_rows
from ref.gemma4.audio_config import AudioConfig
from ref.gemma4.vision import ClippableLinear
from ref.layers import RMSNorm, Weight, linear, rms_norm

# --- pure functions --------------------------------------------------------------------------


def layer_norm(x, weight, eps):
    """LayerNorm over the last axis without bias, in (at least) float32: x [..., C] → x's dtype."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(acc)
    centred = xf - jnp.mean(xf, axis=-1, keepdims=True)
    normed = centred * lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(acc)).astype(x.dtype)


def subsample(x, taps, weight, norm_weight, eps):
    """One subsampling layer: Conv2d k 3, stride 2, pad 1 (time taps by index, mel padded), no
    bias → LayerNorm → ReLU.

    x: [N, F, Cin]; taps: [R, 3] int (N reads zeros); weight: [Cout, Cin, 3, 3] → [R, ⌈F/2⌉, Cout].
    """
    rows = gather_rows(x, taps)  # [R, 3, F, Cin]: a height-3 image per output row
    r, _, f, cin = rows.shape
    out = -(-f // 2)
    # the convolution as one matmul over its 3 × 3 taps (ONNX Conv and Pad are not on the
    # QAIC allow-list): output mel j reads mel 2j − 1, 2j, 2j + 1, zero outside [0, F)
    mel = 2 * np.arange(out)[None, :] + np.arange(-1, 2)[:, None]  # [3, F']
    inside = jnp.asarray(((mel >= 0) & (mel < f))[:, :, None])
    taps_mel = jnp.where(inside, rows[:, :, np.clip(mel, 0, f - 1)], jnp.zeros((), rows.dtype))
    patches = taps_mel.transpose(0, 3, 1, 2, 4).reshape(r, out, 9 * cin)  # (time, mel, Cin)
    w = weight.astype(x.dtype).transpose(2, 3, 1, 0).reshape(9 * cin, -1)  # (time, mel, Cin)
    return jnp.maximum(layer_norm(jnp.matmul(patches, w), norm_weight, eps), 0)


def softplus(x):
    """log(1 + eˣ) written as max(x, 0) + log(1 + e^−|x|): ONNX Softplus is not on the QAIC
    allow-list (float32 within 1 ulp of `jax.nn.softplus` where |x| < 10)."""
    return jnp.maximum(x, 0) + jnp.log(1 + jnp.exp(-jnp.abs(x)))


def clamp(x, bound):
    """x clamped to ±bound (transformers' gradient_clipping, at most the dtype's largest). The
    bound is a constant of x's dtype: a Python float is converted inside the traced function,
    and that conversion of the released 1e10 to float16 read as an overflow of its own in
    `ref.numerics.probe`, where the graph's Clip reads it as the constant ±inf it is."""
    bound = np.asarray(min(float(bound), float(jnp.finfo(x.dtype).max)), x.dtype)
    return jnp.clip(x, -bound, bound)


def causal_depthwise(x, taps, weight):
    """Causal depthwise conv: out[t, d] = Σ_j weight[d, 0, j] · x[taps[t, j], d].

    x: [M, D]; taps: [M, K] int (M reads zeros); weight: [D, 1, K] → [M, D].
    """
    taps_w = jnp.transpose(weight[:, 0, :]).astype(x.dtype)  # [K, D]
    return jnp.sum(gather_rows(x, taps) * taps_w, axis=1)  # not einsum: off the QAIC allow-list


def relative_embeddings(config, dtype):
    """The sinusoid table the attention's relative keys project: [npos, hidden], row j the
    position npos − 1 − j (descending to 0), `[sin(p·f), cos(p·f)]` with f the hidden/2
    timescales 10000^(−i / (hidden/2 − 1))."""
    half = config.hidden_size // 2
    npos = config.relative_positions
    increment = math.log(10000.0) / max(half - 1, 1)
    timescales = np.exp(np.arange(half) * -increment)
    angles = np.arange(npos - 1, -1, -1)[:, None] * timescales[None, :]
    return jnp.asarray(np.concatenate([np.sin(angles), np.cos(angles)], axis=-1), dtype)


# --- modules ---------------------------------------------------------------------------------


# transformers builds these RMSNorms with their default eps, not the config's: rms_norm_eps
# reaches only the light conv's norms, the subsampling LayerNorms and embed_audio.
DEFAULT_EPS = 1e-6


class Dense(nn.Module):
    """A linear with bias: `weight` [out, in], `bias` [out]."""

    features: int

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.lecun_normal(), (self.features, x.shape[-1]))
        b = self.param("bias", nn.initializers.zeros, (self.features,))
        return linear(x, w) + b.astype(x.dtype)


class Scale(nn.Module):
    """A `weight` [size] initialized to ones (a norm's scale)."""

    size: int

    @nn.compact
    def __call__(self):
        return self.param("weight", nn.initializers.ones, (self.size,))


class SubsampleLayer(nn.Module):
    """Gemma4AudioSubSampleConvProjectionLayer: `conv.weight` [Cout, Cin, 3, 3], `norm.weight`."""

    channels: int
    eps: float

    @nn.compact
    def __call__(self, x, taps):
        """x: [N, F, Cin]; taps: [R, 3] → [R, ⌈F/2⌉, Cout]."""
        w = Weight((self.channels, x.shape[-1], 3, 3), name="conv")()
        return subsample(x, taps, w, Scale(self.channels, name="norm")(), self.eps)


class SubsampleConvProjection(nn.Module):
    """`subsample_conv_projection`: layer0, layer1, then `input_proj_linear` (no bias)."""

    config: AudioConfig

    @nn.compact
    def __call__(self, frames, first_taps, second_taps):
        """frames: [N, 128]; first_taps: [R, 3]; second_taps: [M, 3] → [M, hidden]."""
        c = self.config
        first, second = c.subsampling_conv_channels
        x = SubsampleLayer(first, c.rms_norm_eps, name="layer0")(frames[:, :, None], first_taps)
        x = SubsampleLayer(second, c.rms_norm_eps, name="layer1")(x, second_taps)
        x = x.reshape(x.shape[0], -1)  # (mel, channel), channel fastest
        return linear(x, Weight((c.hidden_size, x.shape[-1]), name="input_proj_linear")())


class FeedForward(nn.Module):
    """Gemma4AudioFeedForward: `x + residual_weight · post(ffw_2(silu(ffw_1(pre(clamp(x))))))`,
    the FFN's output clamped before `post`."""

    config: AudioConfig

    @nn.compact
    def __call__(self, x):
        """x: [M, D] → [M, D]."""
        c = self.config
        clip, d = c.use_clipped_linears, c.hidden_size
        h = RMSNorm(DEFAULT_EPS, name="pre_layer_norm")(clamp(x, c.gradient_clipping))
        h = jax.nn.silu(ClippableLinear(4 * d, clip, name="ffw_layer_1")(h))
        h = clamp(ClippableLinear(d, clip, name="ffw_layer_2")(h), c.gradient_clipping)
        h = RMSNorm(DEFAULT_EPS, name="post_layer_norm")(h)
        return h * jnp.asarray(c.residual_weight, h.dtype) + x


class Attention(nn.Module):
    """Gemma4AudioAttention: q scaled by `head_dim^−½ / ln 2 · softplus(per_dim_scale)`, k by
    `ln(1 + e) / ln 2`, relative keys `relative_k_proj(relative_embeddings)`, chunked local
    attention, `post`."""

    config: AudioConfig

    @nn.compact
    def __call__(self, x, index):
        """x: [M, D]; index: the packing's arrays → [M, D]."""
        c = self.config
        m, heads, hd, clip = x.shape[0], c.num_attention_heads, c.head_dim, c.use_clipped_linears

        def project(name):
            return ClippableLinear(c.hidden_size, clip, name=name)(x).reshape(m, heads, hd)

        per_dim_scale = self.param("per_dim_scale", nn.initializers.zeros, (hd,))
        q_scale = jnp.asarray(hd**-0.5 / math.log(2), x.dtype)
        q = project("q_proj") * q_scale * softplus(per_dim_scale.astype(x.dtype))
        k = project("k_proj") * jnp.asarray(math.log(1 + math.e) / math.log(2), x.dtype)
        table = relative_embeddings(c, x.dtype)
        rel_k = linear(table, Weight((c.hidden_size, c.hidden_size), name="relative_k_proj")())
        out = chunked_attention(
            q,
            k,
            project("v_proj"),
            rel_k.reshape(-1, heads, hd),
            index["chunk_queries"],
            index["chunk_keys"],
            index["token_slots"],
            past=c.max_past,
            future=c.attention_context_right,
            cap=c.attention_logit_cap,
            invalid=c.attention_invalid_logits_value,
        )
        return ClippableLinear(c.hidden_size, clip, name="post")(out.reshape(m, -1))


class LightConv(nn.Module):
    """Gemma4AudioLightConv1d: `x + linear_end(silu(conv_norm(clamp(depthwise(glu(
    linear_start(pre(x))))))))`, the depthwise conv causal over the clip's own tokens."""

    config: AudioConfig

    @nn.compact
    def __call__(self, x, taps):
        """x: [M, D]; taps: [M, K] → [M, D]."""
        c = self.config
        d, clip, eps = c.hidden_size, c.use_clipped_linears, c.rms_norm_eps
        h = RMSNorm(eps, name="pre_layer_norm")(x)
        h = ClippableLinear(2 * d, clip, name="linear_start")(h)
        h = h[:, :d] * jax.nn.sigmoid(h[:, d:])
        w = Weight((d, 1, c.conv_kernel_size), name="depthwise_conv1d")()
        h = causal_depthwise(h, taps, w)
        h = RMSNorm(eps, name="conv_norm")(clamp(h, c.gradient_clipping))
        return ClippableLinear(d, clip, name="linear_end")(jax.nn.silu(h)) + x


class ConformerLayer(nn.Module):
    """Gemma4AudioLayer: ½FFN, attention (clamped, normed before and after, residual), light
    conv, ½FFN, clamp, `norm_out`."""

    config: AudioConfig

    @nn.compact
    def __call__(self, x, index):
        """x: [M, D]; index: the packing's arrays → [M, D]."""
        c = self.config
        x = FeedForward(c, name="feed_forward1")(x)
        h = RMSNorm(DEFAULT_EPS, name="norm_pre_attn")(clamp(x, c.gradient_clipping))
        h = Attention(c, name="self_attn")(h, index)
        x = RMSNorm(DEFAULT_EPS, name="norm_post_attn")(clamp(h, c.gradient_clipping)) + x
        x = LightConv(c, name="lconv1d")(x, index["causal_taps"])
        x = FeedForward(c, name="feed_forward2")(x)
        return RMSNorm(DEFAULT_EPS, name="norm_out")(clamp(x, c.gradient_clipping))


class Layers(nn.Module):
    """`layers`: conformer layers named "0", "1", … as in the checkpoint."""

    config: AudioConfig
    keep_states: bool = True

    @nn.compact
    def __call__(self, x, index):
        """x: [M, D] → (x [M, D], every layer's output: tuple of L arrays [M, D], or ())."""
        states = []
        for i in range(self.config.num_hidden_layers):
            x = ConformerLayer(self.config, name=str(i))(x, index)
            if self.keep_states:
                states.append(x)
        return x, tuple(states)


class AudioModel(nn.Module):
    """Gemma4AudioModel on packed clips.

    __call__(frames [N, 128], index: the packing's arrays) → dict with "tokens" [M, output_proj_
    dims] (HF's last_hidden_state at the clips' valid positions, filler rows last: any values),
    "subsampled" [M, hidden] (the subsampling's output) and "hidden_states" (every layer's
    output, [M, hidden] each; () unless keep_states).
    """

    config: AudioConfig
    keep_states: bool = True

    @nn.compact
    def __call__(self, frames, index):
        c = self.config
        sub = SubsampleConvProjection(c, name="subsample_conv_projection")
        x = sub(frames, index["first_taps"], index["second_taps"])
        last, states = Layers(c, self.keep_states, name="layers")(x, index)
        tokens = Dense(c.output_proj_dims, name="output_proj")(last)
        return {"tokens": tokens, "subsampled": x, "hidden_states": states}


class EmbedAudio(nn.Module):
    """`embed_audio`: RMSNorm without scale (eps rms_norm_eps), then `embedding_projection` to
    the text width. x: [M, output_proj_dims] → [M, text_hidden]."""

    config: AudioConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        if c.text_hidden_size is None:
            raise ValueError("embed_audio needs text_hidden_size: load a full Gemma 4 config")
        w = Weight((c.text_hidden_size, x.shape[-1]), name="embedding_projection")()
        return linear(rms_norm(x, None, c.rms_norm_eps), w)
