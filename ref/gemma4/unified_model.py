"""`Gemma4Unified`: Gemma 4 12B Unified (`gemma4_unified`) end to end — the Gemma 4 decoder
(`Gemma4`'s prefill, decode, schedule and soft-token plumbing, unchanged) with the two
embedders of `ref.gemma4.unified` in place of the vision and audio towers.

As transformers' Gemma4UnifiedForConditionalGeneration generates with a static cache
(checked in tests/ref/test_unified.py): an image's and a video frame's soft tokens fill its
run of image or video tokens, attended bidirectionally within the run on sliding layers only,
inside the window (Gemma 4's rule; transformers' default dynamic-cache path masks otherwise,
see docs/codegen.md); an audio clip's fill its run of audio tokens, causal; the token
embedding is scaled by √hidden, the soft tokens are not.
"""

import jax.numpy as jnp
import numpy as np

from ref import sharding
from ref.gemma4 import decoding
from ref.gemma4 import unified_config as U
from ref.gemma4.model import Gemma4
from ref.gemma4.prompts import prompt_tokens
from ref.gemma4.tower import checkpoint_loader
from ref.gemma4.unified import audio_apply, vision_apply
from ref.gemma4.unified_media import (
    BLOCKS,
    UNIFIED_MEDIA,
    audio_frames,
    check_audio,
    grid_positions,
)


def _embedder_params(params, names):
    """{name: `model.<name>`} of a checkpoint tree for each of `names`, or None if one is
    missing."""
    model = params.get("model", {})
    if any(n not in model for n in names):
        return None
    return {n: model[n] for n in names}


class UnifiedVision:
    """`embed_vision` with its parameters: `embed(patches, grids)` as `VisionTower.embed`;
    `apply` (`vision_apply`'s signature) is what computes it, which a device model replaces
    (codegen/check/drift.py)."""

    def __init__(self, config, params, dtype=jnp.float32, mesh=None):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.params = sharding.put(params, self.dtype, sharding.auto_axes(mesh), "model.")
        self.apply = vision_apply

    def embed(self, patches, grids):
        """Soft tokens per item: patches[i] [h_i·w_i, (p·k)²·3] in [0, 1], row-major over its
        (h_i, w_i) grid of blocks → list of [h_i·w_i, text_hidden]."""
        c = self.config
        grids = [(int(h), int(w)) for h, w in grids]
        if len(patches) != len(grids):
            raise ValueError(
                f"{len(patches)} patch arrays for {len(grids)} grids: expected one each"
            )
        for i, ((h, w), p) in enumerate(zip(grids, patches, strict=True)):
            if np.shape(p) != (h * w, c.patch_dim):
                raise ValueError(
                    f"item {i}: patches of shape {np.shape(p)} for grid {h}×{w}: expected "
                    f"[{h * w}, {c.patch_dim}]"
                )
            if max(h, w) > c.mm_posemb_size:
                raise ValueError(
                    f"item {i}: grid {h}×{w} is past the position table's {c.mm_posemb_size} "
                    "rows per axis"
                )
        if not grids:
            return []
        flat = jnp.asarray(np.concatenate([np.asarray(p) for p in patches]), self.dtype)
        out = np.asarray(self.apply(self.params, flat, grid_positions(grids), config=c))
        cu = np.cumsum([0, *(h * w for h, w in grids)])
        return [out[a:b] for a, b in zip(cu[:-1], cu[1:], strict=True)]


class UnifiedAudio:
    """`embed_audio` with its parameters: `encode_waveforms` as `AudioTower`'s (embedded)."""

    def __init__(self, config, params, dtype=jnp.float32, mesh=None):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.params = sharding.put(params, self.dtype, sharding.auto_axes(mesh), "model.")
        self.params = self.params["embed_audio"]

    def encode_waveforms(self, waveforms, embed=True, name="waveforms"):
        """Clips [n_i] at 16 kHz → ([Σ ⌈n_i / 640⌉, text_hidden], per-clip counts)."""
        if not embed:
            raise ValueError("Gemma 4 12B Unified has no audio tower: only embedded frames exist")
        frames = [
            audio_frames(check_audio(w, f"{name}[{i}]"), self.config.audio_embed_dim)
            for i, w in enumerate(waveforms)
        ]
        flat = jnp.asarray(np.concatenate(frames), self.dtype)
        out = np.asarray(audio_apply(self.params, flat, config=self.config))
        return out, [len(f) for f in frames]


class Gemma4Unified(Gemma4):
    """Gemma 4 12B Unified: `Gemma4` with `UnifiedVision` as its vision and `UnifiedAudio` as
    its audio, its processor's pixels (48-px blocks in [0, 1]) and 640-sample frames."""

    media = UNIFIED_MEDIA

    def media_sizes(self):
        """48-px blocks, one soft token each (`ref.gemma4.unified_media.BLOCKS`)."""
        return dict(BLOCKS)

    @classmethod
    def from_params(cls, hf_config, params, dtype=jnp.float32, mesh=None, generation_config=None):
        """From a gemma4_unified config dict and its checkpoint tree (`model.language_model.…`,
        `model.embed_vision.…` and `model.embed_audio.…` where the config has their parts,
        optional `lm_head.weight`); the rest as `Gemma4.from_params`."""
        config = U.text_config(hf_config)
        text = params.get("model", {}).get("language_model", {})
        if "embed_tokens" not in text or "layers" not in text:
            raise ValueError(
                "gemma4_unified parameter tree holds no text decoder: expected "
                "model.language_model.{embed_tokens,layers,…}"
            )
        parts = []
        for names, read, kind in (
            (("vision_embedder", "embed_vision"), U.vision_config, UnifiedVision),
            (("embed_audio",), U.audio_config, UnifiedAudio),
        ):
            part, found = read(hf_config), _embedder_params(params, names)
            if part is not None and found is None:
                raise ValueError(
                    f"the config has a {read.__name__.split('_')[0]} part but the checkpoint "
                    f"lacks one of model.{{{','.join(names)}}}"
                )
            parts.append(None if part is None else kind(part, found, dtype, mesh))
        lm_head = params.get("lm_head", {}).get("weight")
        stop, pad, suppress = decoding.generation_ids(generation_config, hf_config)
        tokens = prompt_tokens(hf_config)
        vision, audio = parts
        return cls(config, text, lm_head, vision, dtype, tokens, mesh, stop, pad, audio, suppress)

    @classmethod
    def from_pretrained(cls, model_dir, dtype=jnp.float32, mesh=None, generation_config=None):
        """From a gemma4_unified model folder (as `Gemma4.from_pretrained`)."""
        hf_config, params = checkpoint_loader()(model_dir, lazy=mesh is not None)
        U.check_unified(hf_config)
        return cls.from_params(hf_config, params, dtype, mesh, generation_config)
