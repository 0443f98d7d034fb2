"""transformers' Gemma4AudioModel, Gemma4MultimodalEmbedder and Gemma4AudioFeatureExtractor as the
oracles of the audio tower: built from a config, every tensor randomized."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import torch
from transformers import Gemma4AudioConfig
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel, Gemma4MultimodalEmbedder

# Gemma4AudioConfig kwargs of a tiny tower (`tests.text_oracle.hf_model(audio=…)`)
TINY_AUDIO = dict(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[128, 4],
    output_proj_dims=12,
)


def hf_audio_config(cfg):
    """A transformers Gemma4AudioConfig from our AudioConfig (eager attention)."""
    fields = dataclasses.asdict(cfg)
    fields.pop("text_hidden_size")
    fields["subsampling_conv_channels"] = list(fields["subsampling_conv_channels"])
    hf = Gemma4AudioConfig(**fields)
    hf._attn_implementation = "eager"
    return hf


def randomize_audio_(module, seed, clip_scale=1.0):
    """Randomize every parameter and buffer of an audio tower or embedder in place, away from
    neutral values.

    Linear and conv weights ~ N(0, 1/fan_in); norm scales around 1; per_dim_scale and
    output_proj's bias random; clip bounds ±(0.5 … 2.5)·clip_scale, tight enough to clip the
    normed activations (unit RMS).
    """
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float64)

    def bound():
        return clip_scale * (0.5 + 2 * torch.rand((), generator=g, dtype=torch.float64))

    with torch.no_grad():
        for name, t in list(module.state_dict().items()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "weight" and t.ndim >= 2:
                new = randn(t.shape) / np.sqrt(np.prod(t.shape[1:]))
            elif leaf == "weight":
                new = 1 + 0.2 * randn(t.shape)
            elif leaf in ("per_dim_scale", "bias"):
                new = 0.5 * randn(t.shape)
            elif leaf in ("input_min", "output_min"):
                new = -bound()
            elif leaf in ("input_max", "output_max"):
                new = bound()
            else:
                raise AssertionError(f"randomize_audio_: no rule for {name}")
            t.copy_(new.to(t.dtype))
    return module


def hf_audio_model(cfg, seed):
    """A randomized float32 Gemma4AudioModel in eval mode."""
    torch.manual_seed(seed)
    return randomize_audio_(Gemma4AudioModel(hf_audio_config(cfg)).eval(), seed)


def hf_audio_embedder(cfg, seed):
    """A randomized Gemma4MultimodalEmbedder (embed_audio) to cfg.text_hidden_size."""
    text = SimpleNamespace(hidden_size=cfg.text_hidden_size)
    embedder = Gemma4MultimodalEmbedder(hf_audio_config(cfg), text).eval()
    return randomize_audio_(embedder, seed)


def hf_features(waveforms):
    """Gemma4AudioFeatureExtractor on a list of clips (one batch, padded to the longest):
    (features [B, T, 128] float32, masks [B, T] bool). A single 1-D array is not batched: it
    fails in transformers 5.25 (its padding reads the clip as one sample of n channels)."""
    out = Gemma4AudioFeatureExtractor()([np.asarray(w) for w in waveforms])
    return np.stack(out["input_features"]), np.stack(out["input_features_mask"])


def hf_encode(model, features, mask, embedder=None):
    """One clip through transformers: (its valid soft tokens [n, output_proj_dims], or after
    `embedder` [n, text_hidden]; per-layer outputs, [n, hidden] each, valid rows)."""
    with torch.no_grad():
        out = model(
            torch.from_numpy(features[None]),
            torch.from_numpy(mask[None]),
            output_hidden_states=True,
        )
        tokens = out.last_hidden_state
        if embedder is not None:
            tokens = embedder(tokens)
    valid = out.attention_mask[0].numpy()
    states = [s[0].numpy()[valid] for s in out.hidden_states]
    return tokens[0].numpy()[valid], states
