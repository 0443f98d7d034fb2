"""Gemma 4 12B Unified (`gemma4_unified`): its config.json as dataclasses, checked.

The text part is the Gemma 4 decoder's `TextConfig` without per-layer inputs or MoE (read with
Gemma4UnifiedTextConfig's defaults where a key is absent); the vision and audio parts are the
two embedders' sizes (`ref.gemma4.unified`). transformers 5.25's
configuration_gemma4_unified.py is the source of every default here.
"""

from dataclasses import dataclass, replace

from ref.gemma4.config import refuse_invalid
from ref.gemma4.text_config import TextConfig

MODEL_TYPE = "gemma4_unified"
# Gemma4UnifiedTextConfig's defaults where they differ from Gemma4TextConfig's
TEXT_DEFAULTS = {"sliding_window": 1024, "use_bidirectional_attention": "vision"}


@dataclass(frozen=True)
class UnifiedVisionConfig:
    """The vision embedder's sizes (hashable: a jit static argument).

    A soft token is one (k·p)² × 3 block of pixels (`patch_dim` values, 6,912 at p = 16, k = 3);
    `mm_posemb_size` rows per axis in the position table; `text_hidden_size` the output width.
    """

    text_hidden_size: int
    # the processor's 16-px patches merged 3×3: one soft token per 48-px block
    patch_size: int = 16
    pooling_kernel_size: int = 3
    # the embedder's width, its position table's rows per axis, the projection's input width
    mm_embed_dim: int = 3840
    mm_posemb_size: int = 1120
    rms_norm_eps: float = 1e-6
    output_proj_dims: int = 3840

    def __post_init__(self):
        checks = {
            f: isinstance(getattr(self, f), int) and getattr(self, f) > 0
            for f in (
                "text_hidden_size",
                "patch_size",
                "pooling_kernel_size",
                "mm_embed_dim",
                "mm_posemb_size",
                "output_proj_dims",
            )  # fmt: skip
        }
        checks["rms_norm_eps"] = self.rms_norm_eps > 0
        checks["output_proj_dims"] &= self.output_proj_dims == self.mm_embed_dim
        refuse_invalid(
            self, checks, "gemma4_unified vision",
            "sizes and eps must be positive, output_proj_dims equal to mm_embed_dim (the "
            "embedder's last norm reads the position-normed patches)",
        )  # fmt: skip

    @property
    def model_patch_size(self):
        """Pixels per side of one soft token's block: p·k."""
        return self.patch_size * self.pooling_kernel_size

    @property
    def patch_dim(self):
        """Values per soft token: (p·k)² · 3, (row, column, channel) with channel fastest."""
        return 3 * self.model_patch_size**2


@dataclass(frozen=True)
class UnifiedAudioConfig:
    """The audio embedder's sizes: `audio_embed_dim` samples per frame (one soft token)."""

    text_hidden_size: int
    audio_embed_dim: int = 640
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        checks = {
            "text_hidden_size": isinstance(self.text_hidden_size, int)
            and self.text_hidden_size > 0,
            "audio_embed_dim": isinstance(self.audio_embed_dim, int) and self.audio_embed_dim > 0,
            "rms_norm_eps": self.rms_norm_eps > 0,
        }
        refuse_invalid(self, checks, "gemma4_unified audio", "sizes and eps must be positive")


def _fields(cls, part):
    return {f: part[f] for f in cls.__dataclass_fields__ if f in part and f != "text_hidden_size"}


def _part(config, key):
    part = config.get(key)
    if part is not None and not isinstance(part, dict):
        raise ValueError(f"{key}={part!r:.60}: expected a dict or null")
    return part


def check_unified(config):
    """Refuse a config dict that is not a gemma4_unified one (one line naming what it is)."""
    if not isinstance(config, dict):
        raise ValueError(f"expected a gemma4_unified config dict, got {type(config).__name__}")
    kind = config.get("model_type")
    if kind != MODEL_TYPE:
        raise ValueError(f"model_type={kind!r}: expected {MODEL_TYPE!r} (Gemma 4 12B Unified)")
    if not isinstance(config.get("text_config"), dict):
        raise ValueError("gemma4_unified config has no text_config dict")


def text_config(config):
    """The decoder's TextConfig of a gemma4_unified config dict: no per-layer inputs, no MoE."""
    check_unified(config)
    text = config["text_config"]
    if text.get("enable_moe_block"):
        raise ValueError("text_config.enable_moe_block=True: Gemma 4 12B Unified has no experts")
    per_layer = text.get("hidden_size_per_layer_input") or 0
    if per_layer:
        raise ValueError(
            f"text_config.hidden_size_per_layer_input={per_layer!r}: expected 0 or absent "
            "(Gemma 4 12B Unified has no per-layer inputs)"
        )
    full = dict(config, text_config={**TEXT_DEFAULTS, **text})
    return replace(
        TextConfig.from_hf(full), hidden_size_per_layer_input=0, vocab_size_per_layer_input=0
    )


def _embedder_config(config, key, cls):
    check_unified(config)
    part = _part(config, key)
    if part is None:
        return None
    hidden = int(config["text_config"]["hidden_size"])
    return cls(text_hidden_size=hidden, **_fields(cls, part))


def any_text_config(config):
    """The decoder's TextConfig of any Gemma 4 config dict: a gemma4_unified one read as
    `text_config` does, the others by `TextConfig.from_hf`."""
    if isinstance(config, dict) and config.get("model_type") == MODEL_TYPE:
        return text_config(config)
    return TextConfig.from_hf(config)


def vision_config(config):
    """The UnifiedVisionConfig of a gemma4_unified config dict, or None without vision_config."""
    return _embedder_config(config, "vision_config", UnifiedVisionConfig)


def audio_config(config):
    """The UnifiedAudioConfig of a gemma4_unified config dict, or None without audio_config."""
    return _embedder_config(config, "audio_config", UnifiedAudioConfig)
