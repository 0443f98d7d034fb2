"""Gemma 4 vision configuration, parsed from Hugging Face config dicts."""

from dataclasses import dataclass


def refuse_invalid(config, checks, kind, rules):
    """ValueError naming each field of `config` whose check failed (checks: {field: ok}), then
    `rules` (what the fields must be); nothing when all hold."""
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        named = ", ".join(f"{n}={getattr(config, n)!r}" for n in bad)
        raise ValueError(f"invalid {kind} config {named}: {rules}")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyper-parameters (hashable: usable as a jit static argument)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100.0
    pooling_kernel_size: int = 3
    patch_size: int = 16
    position_embedding_size: int = 10240
    use_clipped_linears: bool = False
    standardize: bool = False
    text_hidden_size: int | None = None

    def __post_init__(self):
        checks = {
            "hidden_size": self.hidden_size > 0,
            "num_hidden_layers": self.num_hidden_layers >= 0,
            "num_attention_heads": self.num_attention_heads > 0,
            "num_key_value_heads": self.num_key_value_heads > 0
            and self.num_attention_heads % self.num_key_value_heads == 0,
            "head_dim": self.head_dim > 0 and self.head_dim % 4 == 0,
            "pooling_kernel_size": self.pooling_kernel_size > 0,
            "patch_size": self.patch_size > 0,
            "position_embedding_size": self.position_embedding_size > 0,
        }
        refuse_invalid(
            self,
            checks,
            "vision",
            "sizes must be positive, query heads a multiple of kv heads, head_dim divisible by 4",
        )

    @property
    def patch_dim(self):
        """Values per patch: 3·p·p, channel fastest."""
        return 3 * self.patch_size * self.patch_size

    @classmethod
    def from_hf(cls, config):
        """From a Gemma4VisionConfig dict, or a full Gemma4Config dict (adds the text width)."""
        vision = config.get("vision_config", config) if isinstance(config, dict) else None
        if not isinstance(vision, dict):
            raise ValueError(
                f"expected a Gemma 4 config dict with a vision part, got {config!r:.80}"
            )
        if config.get("model_type") == "gemma4" and vision is config:
            raise ValueError("Gemma 4 config has no vision_config: a text-only model has no tower")
        activation = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation={activation!r}: expected 'gelu_pytorch_tanh'")
        rope = vision.get("rope_parameters") or {}
        # the released checkpoints say "default", which transformers reads as the tower's
        # default, "axial" (RotaryEmbeddingConfigMixin.default_rope_type)
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(
                f"rope_type={rope.get('rope_type')!r}: expected 'axial' (or 'default', read as "
                "axial as transformers does)"
            )
        text = config.get("text_config") if vision is not config else None
        fields = {f: vision[f] for f in cls.__dataclass_fields__ if f in vision}
        fields.pop("text_hidden_size", None)
        fields["rope_theta"] = float(rope.get("rope_theta", cls.rope_theta))
        if isinstance(text, dict) and "hidden_size" in text:
            fields["text_hidden_size"] = int(text["hidden_size"])
        return cls(**fields)
