"""`AudioTower`: the packed Gemma 4 audio tower with its parameters, and its jit-compiled forward.

tower = AudioTower.from_params(hf_config, checkpoint_tree)   # or .from_pretrained(model_dir)
tokens, counts = tower.encode(features, masks)    # [Σ counts, output_proj_dims], per-clip counts
embeds, counts = tower.embed(features, masks)     # the same after embed_audio
embeds, counts = tower.encode_waveforms(waveforms, embed=True)   # from 16 kHz samples
"""

import jax
import jax.numpy as jnp
import numpy as np

from ref import sharding
from ref.gemma4.audio import AudioModel, EmbedAudio
from ref.gemma4.audio_config import AudioConfig
from ref.gemma4.audio_features import log_mel
from ref.gemma4.audio_packing import clip_frames, pack, pack_frames
from ref.gemma4.tower import checkpoint_loader, split_tree

AUDIO = "model.audio_tower."


def audio_apply(params, embed_params, frames, index, *, config, keep_states=True):
    """The packed tower (not compiled; `audio_forward` is its jit); `embed_params=None` skips
    embed_audio.

    frames: [N, 128]; index: `AudioPacking.arrays` → {"tokens": [M, output_proj_dims],
    "subsampled": [M, hidden], "hidden_states": L × [M, hidden] (() unless keep_states),
    "embeds": [M, text_hidden] or absent}.
    """
    out = AudioModel(config, keep_states).apply({"params": params}, frames, index)
    if embed_params is not None:
        out["embeds"] = EmbedAudio(config).apply({"params": embed_params}, out["tokens"])
    return out


audio_forward = jax.jit(audio_apply, static_argnames=("config", "keep_states"))


# the top-level keys of an audio tower saved alone
AUDIO_ALONE = ("subsample_conv_projection", "layers")


class AudioTower:
    """The packed Gemma 4 audio tower with its parameters, ready to encode clips."""

    def __init__(self, config, params, embed_params=None, dtype=jnp.float32, mesh=None):
        """mesh: None (one device) or a `jax.sharding.Mesh` the parameters are put on by
        `ref.sharding.RULES`, each device's blocks read from the leaves alone (as
        `VisionTower`)."""
        mesh = sharding.auto_axes(mesh)
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.params = sharding.put(params, self.dtype, mesh, AUDIO)
        self.embed_params = None
        if embed_params is not None:
            self.embed_params = sharding.put(embed_params, self.dtype, mesh, "model.embed_audio.")

    @classmethod
    def from_params(cls, hf_config, params, dtype=jnp.float32, mesh=None):
        """From an HF config dict and a checkpoint tree (tower-only or full model)."""
        tower, embed = split_tree(params, "audio_tower", "embed_audio", AUDIO_ALONE)
        return cls(AudioConfig.from_hf(hf_config), tower, embed, dtype, mesh)

    @classmethod
    def from_pretrained(cls, model_dir, dtype=jnp.float32, mesh=None):
        """From an HF model folder (config.json + safetensors with `model.audio_tower.*`), read
        by the `weights` package; with a mesh, each device reads only its blocks."""
        hf_config, params = checkpoint_loader()(model_dir, lazy=mesh is not None)
        return cls.from_params(hf_config, params, dtype, mesh)

    def pack(self, features, masks=None, *, frame_budget=None, max_clips=None):
        """(AudioPacking, packed frames [N, 128]) of per-clip features [T_i, 128] and masks
        [T_i] bool (None: every frame valid); only each clip's valid frames are packed."""
        clips = clip_frames(features, masks)
        packing = pack(
            [len(c) for c in clips], self.config, frame_budget=frame_budget, max_clips=max_clips
        )
        return packing, pack_frames(clips, packing)

    def run(self, features, masks=None, *, frame_budget=None, max_clips=None, embed=False):
        """The packed forward and its metadata: (AudioPacking, output dict of `audio_forward`
        with every layer's output)."""
        if embed and self.embed_params is None:
            raise ValueError("embed needs embed_audio weights: load a full Gemma 4 checkpoint")
        packing, frames = self.pack(features, masks, frame_budget=frame_budget, max_clips=max_clips)
        out = audio_forward(
            self.params,
            self.embed_params if embed else None,
            jnp.asarray(frames, self.dtype),
            packing.arrays,
            config=self.config,
        )
        return packing, out

    def _tokens(self, key, features, masks, **budget):
        width = self.config.output_proj_dims if key == "tokens" else self.config.text_hidden_size
        clips = clip_frames(features, masks)
        if not any(len(c) for c in clips) and budget.get("frame_budget") is None:
            counts = pack([0] * len(clips), self.config).token_counts
            return np.zeros((0, width), self.dtype), counts
        packing, out = self.run(features, masks, embed=key == "embeds", **budget)
        return np.asarray(out[key])[: packing.num_real_tokens], packing.token_counts

    def encode(self, features, masks=None, *, frame_budget=None, max_clips=None):
        """Soft tokens of all clips, concatenated: ([Σ counts, output_proj_dims], per-clip
        counts). features[i]: [T_i, 128]; masks[i]: [T_i] bool (`ref.gemma4.audio_features`)."""
        return self._tokens(
            "tokens", features, masks, frame_budget=frame_budget, max_clips=max_clips
        )

    def embed(self, features, masks=None, *, frame_budget=None, max_clips=None):
        """Soft tokens after embed_audio: ([Σ counts, text_hidden], per-clip counts)."""
        if self.embed_params is None:
            raise ValueError("embed needs embed_audio weights: load a full Gemma 4 checkpoint")
        return self._tokens(
            "embeds", features, masks, frame_budget=frame_budget, max_clips=max_clips
        )

    def encode_waveforms(self, waveforms, *, embed=False, name="waveforms"):
        """`encode` (or `embed`) of 16 kHz clips, each [n] float samples, 1 ≤ n ≤ 480,000
        (`name[i]` in errors)."""
        pairs = [log_mel(w, f"{name}[{i}]") for i, w in enumerate(waveforms)]
        run = self.embed if embed else self.encode
        return run([f for f, _ in pairs], [m for _, m in pairs])
