"""Gemma 4 audio encoder configuration, parsed from Hugging Face config dicts (`audio_config`)."""

from dataclasses import dataclass

from ref.gemma4.config import refuse_invalid

# The subsampling convolutions see the feature extractor's mel bins (ref.gemma4.audio_features:
# 128), halved twice; transformers sizes `input_proj_linear` as (channels[0] // 4)·channels[1].
SUBSAMPLED_MEL_BINS = 32


@dataclass(frozen=True)
class AudioConfig:
    """The audio tower's hyper-parameters, defaults as transformers' Gemma4AudioConfig (hashable:
    usable as a jit static argument). `text_hidden_size` is embed_audio's output width."""

    hidden_size: int = 1024
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    subsampling_conv_channels: tuple = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    text_hidden_size: int | None = None

    def __post_init__(self):
        object.__setattr__(
            self, "subsampling_conv_channels", tuple(int(c) for c in self.subsampling_conv_channels)
        )
        channels = self.subsampling_conv_channels
        checks = {
            "hidden_size": self.hidden_size > 0,
            "num_hidden_layers": self.num_hidden_layers >= 0,
            "num_attention_heads": self.num_attention_heads > 0
            and self.hidden_size % self.num_attention_heads == 0,
            "subsampling_conv_channels": len(channels) == 2
            and channels[0] // 4 == SUBSAMPLED_MEL_BINS
            and channels[1] > 0,
            "conv_kernel_size": self.conv_kernel_size > 0,
            "attention_chunk_size": self.attention_chunk_size > 0,
            "attention_context_left": self.attention_context_left >= 2,
            "attention_context_right": self.attention_context_right >= 0,
            "attention_logit_cap": self.attention_logit_cap > 0,
            "gradient_clipping": self.gradient_clipping > 0,
            "output_proj_dims": self.output_proj_dims > 0,
        }
        refuse_invalid(
            self,
            checks,
            "audio",
            "sizes must be positive, hidden_size a multiple of the heads, two subsampling "
            f"channel counts with channels[0] // 4 == {SUBSAMPLED_MEL_BINS} (the flattened "
            "width transformers gives input_proj_linear), attention_context_left >= 2 "
            "(a frame sees itself and its past), attention_context_right >= 0",
        )

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    @property
    def max_past(self):
        """Past frames a frame sees (transformers' max_past_horizon, context_left − 1)."""
        return self.attention_context_left - 1

    @property
    def context_size(self):
        """Keys of one attention chunk: chunk + past + future."""
        return self.attention_chunk_size + self.max_past + self.attention_context_right

    @property
    def relative_positions(self):
        """Rows of the relative-position table (npos: positions npos − 1 … 0)."""
        return self.context_size // 2 + 1

    @classmethod
    def from_hf(cls, config):
        """From a Gemma4AudioConfig dict, or a full Gemma4Config dict (adds the text width)."""
        if not isinstance(config, dict):
            raise ValueError(f"expected a Gemma 4 config dict, got {config!r:.80}")
        audio = config.get("audio_config", config)
        if audio is None or (audio is config and config.get("model_type") == "gemma4"):
            raise ValueError("Gemma 4 config has no audio_config: this model has no audio tower")
        if not isinstance(audio, dict):
            raise ValueError(f"audio_config {audio!r:.80}: expected a dict")
        activation = audio.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"hidden_act={activation!r}: expected 'silu'")
        fields = {f: audio[f] for f in cls.__dataclass_fields__ if f in audio}
        fields.pop("text_hidden_size", None)
        text = config.get("text_config") if audio is not config else None
        if isinstance(text, dict) and "hidden_size" in text:
            fields["text_hidden_size"] = int(text["hidden_size"])
        return cls(**fields)
