"""Gemma 4 text decoder configuration, resolved per layer from Hugging Face config dicts.

Mirrors what `Gemma4TextConfig.__post_init__` and `kv_sharing_modes` derive, so the decoder
never has to know how transformers stores per-layer overrides.
"""

from dataclasses import dataclass

SLIDING = "sliding_attention"
FULL = "full_attention"
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class Rope:
    """One layer type's RoPE: `kind` is "default" or "proportional" (rotates a fraction)."""

    kind: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class TextConfig:
    """The text decoder's hyper-parameters, per layer where they vary (hashable: jit-static).

    `head_dims`, `kv_heads`, `layer_types` and `kv_source` have one entry per layer;
    `kv_source[i]` is the layer whose keys/values layer i attends to (i itself unless it is a
    KV-sharing consumer, then the last non-shared layer of the same type).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    layer_types: tuple
    head_dims: tuple
    kv_heads: tuple
    kv_source: tuple
    rope: tuple  # ((layer_type, Rope), ...)
    sliding_window: int
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = None
    bidirectional_vision: bool = False
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    pad_token_id: int = 0
    image_token_id: int | None = None
    video_token_id: int | None = None
    audio_token_id: int | None = None

    @property
    def vision_token_ids(self):
        """The placeholder ids that vision soft tokens replace: the image token and the video
        token (each video frame is a run of video tokens), those the config names."""
        return tuple(t for t in (self.image_token_id, self.video_token_id) if t is not None)

    @property
    def num_hidden_layers(self):
        return len(self.layer_types)

    @property
    def enable_moe_block(self):
        return self.num_experts > 0

    def rope_for(self, layer_type):
        """The Rope of a layer type."""
        return dict(self.rope)[layer_type]

    def shares_kv(self, layer):
        """True for a KV-sharing consumer layer (no k/v projections, no cache of its own)."""
        return self.kv_source[layer] != layer

    @classmethod
    def from_hf(cls, config):
        """From a Gemma4TextConfig dict, or a full Gemma4Config dict (adds the image, video and
        audio tokens)."""
        if not isinstance(config, dict):
            raise ValueError(f"expected a Gemma 4 config dict, got {type(config).__name__}")
        text = config.get("text_config", config)
        if not isinstance(text, dict) or "hidden_size" not in text:
            raise ValueError(
                f"config with keys {sorted(config)[:8]} has no Gemma 4 text part "
                "(expected text_config.hidden_size or hidden_size)"
            )
        full = text is not config
        names = ("image_token_id", "video_token_id", "audio_token_id")
        tokens = {f: config.get(f) if full else None for f in names}
        return cls(**_resolve(text), **tokens)


def _resolve(text):
    """The TextConfig fields of an HF text config dict (defaults as in Gemma4TextConfig)."""
    get = text.get
    activation = get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={activation!r}: expected 'gelu_pytorch_tanh'")
    if get("attention_bias", False):
        raise ValueError("attention_bias=True: Gemma 4 projections have no bias")
    bidir = get("use_bidirectional_attention")
    if bidir not in (None, "vision"):
        raise ValueError(
            f"use_bidirectional_attention={bidir!r}: expected None or 'vision' "
            "('all' makes every token bidirectional, which a causal decoder cannot generate with)"
        )
    n = int(get("num_hidden_layers", 30))
    layer_types = list(get("layer_types") or [_default_type(i) for i in range(n)])
    if len(layer_types) != n or set(layer_types) - {SLIDING, FULL}:
        raise ValueError(
            f"layer_types={layer_types!r}: expected {n} entries of {SLIDING!r} or {FULL!r}"
        )
    layer_types[-1] = FULL  # transformers forces it (with a warning)
    head_dims, kv_heads = _per_layer_heads(text, layer_types)
    heads = int(get("num_attention_heads", 8))
    bad = [i for i, h in enumerate(kv_heads) if h < 1 or heads % h]
    if bad:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of the kv heads {kv_heads} "
            f"of layers {bad}"
        )
    moe = bool(get("enable_moe_block", False))
    return dict(
        vocab_size=int(get("vocab_size", 262_144)),
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(get("intermediate_size", 9216)),
        num_attention_heads=heads,
        layer_types=tuple(layer_types),
        head_dims=head_dims,
        kv_heads=kv_heads,
        kv_source=_kv_source(layer_types, int(get("num_kv_shared_layers", 0) or 0)),
        rope=_rope(get("rope_parameters"), layer_types),
        sliding_window=int(get("sliding_window", 512)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=get("final_logit_softcapping"),
        bidirectional_vision=bidir == "vision",
        attention_k_eq_v=bool(get("attention_k_eq_v", False)),
        use_double_wide_mlp=bool(get("use_double_wide_mlp", False)),
        hidden_size_per_layer_input=int(get("hidden_size_per_layer_input", 256) or 0),
        vocab_size_per_layer_input=int(get("vocab_size_per_layer_input", 262_144) or 0),
        num_experts=int(get("num_experts") or 0) if moe else 0,
        top_k_experts=int(get("top_k_experts") or 0) if moe else 0,
        moe_intermediate_size=int(get("moe_intermediate_size") or 0) if moe else 0,
        pad_token_id=int(get("pad_token_id", 0) or 0),
    )


def _default_type(i):
    return SLIDING if (i + 1) % 6 else FULL


def _per_layer_heads(text, layer_types):
    """(head_dims, kv_heads) per layer.

    A saved transformers config carries `per_layer_config` ({"01": {"head_dim": …}}); the
    released checkpoints' configs carry `global_head_dim` / `num_global_key_value_heads`,
    which transformers turns into overrides of the full-attention layers.
    """
    head_dim = int(text.get("head_dim", 256))
    kv = int(text.get("num_key_value_heads", 4))
    overrides = text.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": int(text.get("global_head_dim", 512))}
        global_kv = text.get("num_global_key_value_heads")
        if global_kv is not None and text.get("attention_k_eq_v", True):
            full["num_key_value_heads"] = int(global_kv)
        overrides = {i: full for i, t in enumerate(layer_types) if t == FULL}
    per_layer = [{} for _ in layer_types]
    for key, value in overrides.items():
        i = int(key)
        if not 0 <= i < len(layer_types):
            raise ValueError(
                f"per_layer_config key {key!r} is not a layer index < {len(layer_types)}"
            )
        per_layer[i] = value
    return (
        tuple(int(o.get("head_dim", head_dim)) for o in per_layer),
        tuple(int(o.get("num_key_value_heads", kv)) for o in per_layer),
    )


def _kv_source(layer_types, shared):
    """Which layer's K/V each layer uses (transformers' `kv_sharing_modes`)."""
    n = len(layer_types)
    if not 0 <= shared < n:
        raise ValueError(
            f"num_kv_shared_layers={shared}: expected 0 ≤ value < num_hidden_layers={n} "
            "(some layer must compute the keys and values the others reuse)"
        )
    first = n - shared
    source = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if layer_types[j] == layer_types[i]]
        if not producers:
            raise ValueError(
                f"layer {i} ({layer_types[i]}) shares KV but no earlier layer of that type "
                f"computes it (layer_types={list(layer_types)}, num_kv_shared_layers={shared})"
            )
        source[i] = producers[-1]
    return tuple(source)


def _rope(params, layer_types):
    """((layer_type, Rope), ...) for the layer types present."""
    params = params or _DEFAULT_ROPE
    out = []
    for layer_type in sorted(set(layer_types)):
        p = params.get(layer_type)
        if p is None:
            raise ValueError(f"rope_parameters has no entry for {layer_type!r}: {params!r}")
        kind = p.get("rope_type", "default")
        if kind not in ("default", "proportional"):
            raise ValueError(
                f"rope_type={kind!r} for {layer_type}: expected 'default' or 'proportional'"
            )
        rope = Rope(
            kind=kind,
            theta=float(p.get("rope_theta", 10_000.0)),
            partial_rotary_factor=float(p.get("partial_rotary_factor", 1.0)),
            factor=float(p.get("factor", 1.0)),
        )
        out.append((layer_type, rope))
    return tuple(out)
