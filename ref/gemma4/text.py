"""The Gemma 4 text decoder as Flax Linen modules over pure functions, one step at a time.

A step is a prefill chunk or a decode token: it writes its keys/values into a position-indexed
KV cache and attends over the cache, so a prompt prefilled whole, in chunks, or token by token
gives the same result — as long as no chunk boundary cuts an image run, whose tokens see each
other both ways (see `ref.gemma4.schedule.chunk_bounds`). Module and parameter names are the
checkpoint's own: the subtree under `model.language_model` is `TextModel`'s params as it is.

Soft tokens replace the embeddings of the placeholders: an image's or a video frame's (from the
vision tower, after embed_vision) and an audio clip's (from the audio tower, after
embed_audio), one stream in order of appearance: each batch row reads its own
`vision_embeds[b]` from a running index `image_idx[b]` that the step advances by the number of
placeholders it consumed. Image and video runs may attend both ways (`bidirectional_vision`);
audio runs are causal, as transformers masks them (its `mm_token_type_ids` mark audio 3, and
only 1 and 2, image and video, open a bidirectional block).
"""

from functools import partial

import flax.linen as nn
import jax.numpy as jnp

from ref.gemma4.kv_cache import linear_memory, ring_len, ring_memory, uses_ring
from ref.gemma4.moe import Experts, Router
from ref.gemma4.text_config import FULL, SLIDING, TextConfig
from ref.layers import Embedding, RMSNorm, Weight, gated_mlp, gelu_tanh, linear, rms_norm
from ref.moe_modes import MoeMode
from ref.rope import apply_rope, rope_inv_freq


def vision_runs(is_vision, positions, cache_group=None):
    """Vision-run ids of a chunk's tokens (−1 for text), unique within a row.

    is_vision: [B, S] bool (invalid columns False); positions: [B, S] (−1 = padding, valid
    columns contiguous and increasing); cache_group: [B, T], the ids of the tokens already
    cached, or None (no run continues from an earlier step) → [B, S] int32. A run that
    started in an earlier chunk keeps its id; the n-th run that starts in this chunk gets
    `first position + n`, which no other chunk can use (a chunk of S tokens starts at most S
    runs). Id equality thus matches transformers'
    `get_block_sequence_ids_for_mask` over the whole prompt however it is chunked.
    """
    valid = positions >= 0
    first = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1)
    if cache_group is None:
        carried = jnp.full_like(first[:, None], -1)
    else:
        prev_slot = jnp.clip(first - 1, 0, cache_group.shape[1] - 1)
        prev_group = jnp.take_along_axis(cache_group, prev_slot[:, None], axis=1)[:, 0]
        carried = jnp.where(first >= 1, prev_group, -1)[:, None]  # [B, 1]
    # concatenate, not jnp.pad: ONNX Pad is not among the ops QEfficient's exports use
    prev_vision = jnp.concatenate([jnp.zeros_like(is_vision[:, :1]), is_vision[:, :-1]], axis=1)
    continues = valid & (positions == first[:, None]) & (carried >= 0)
    new_run = is_vision & ~prev_vision & ~continues
    # CumSum, not cummax: jax2onnx lowers cummax to an int MaxPool onnxruntime rejects
    count = jnp.cumsum(new_run.astype(jnp.int32), axis=1)
    ids = jnp.where(count > 0, first[:, None] + count - 1, carried)
    return jnp.where(is_vision, ids, -1).astype(jnp.int32)


def placeholder_masks(input_ids, config):
    """Where a step's soft tokens go: input_ids [B, S] → (placeholder [B, S] bool: image, video
    and audio tokens, each filled from the soft-token stream; vision [B, S] bool: image and
    video tokens only, the runs a bidirectional sliding mask opens)."""
    vision = jnp.zeros(input_ids.shape, bool)
    for token in config.vision_token_ids:
        vision = vision | (input_ids == token)
    if config.audio_token_id is None:
        return vision, vision
    return vision | (input_ids == config.audio_token_id), vision


def embedding_ids(input_ids, placeholder, pad_token_id):
    """The ids the token and per-layer embeddings read: [B, S], every placeholder as the pad
    token (transformers embeds them so: the soft tokens then replace the token embedding, while
    the per-layer input of an image, video or audio position stays the pad token's)."""
    return jnp.where(placeholder, pad_token_id, input_ids)


def within_stream(is_image, vision_size, image_idx):
    """Which placeholders have a soft token left: is_image [B, S] bool (valid placeholders),
    vision_size V, image_idx [B, 1] row b's next unread soft token → [B, S] bool, the
    placeholders whose soft token index (image_idx + those before it) is < V. A placeholder
    past the stream takes none and opens no vision run: it is text, as in a decode step (a
    language program's decode specialization feeds image_idx = V, so a generated image id is
    embedded as transformers embeds it)."""
    index = jnp.cumsum(is_image.astype(jnp.int32), axis=1) - 1 + image_idx
    return is_image & (index < vision_size)


def merge_vision(embeds, is_image, vision_embeds, image_idx):
    """Put each row's next soft tokens where its placeholders are.

    embeds: [B, S, D]; is_image: [B, S] bool (valid placeholders); vision_embeds:
    [B, V, D]; image_idx: [B, 1] int, row b's next unread soft token → (merged [B, S, D],
    image_idx_output [B, 1] = image_idx + placeholders consumed).
    """
    count = is_image.astype(jnp.int32)
    index = jnp.cumsum(count, axis=1) - 1 + image_idx
    index = jnp.clip(index, 0, vision_embeds.shape[1] - 1)
    soft = jnp.take_along_axis(vision_embeds, index[:, :, None], axis=1)
    merged = jnp.where(is_image[:, :, None], soft.astype(embeds.dtype), embeds)
    return merged, image_idx + jnp.sum(count, axis=1, keepdims=True, dtype=image_idx.dtype)


def layer_mask_args(config, positions, groups, full, sliding):
    """Each layer type's mask arguments for `Attention` (keywords of `ref.attention.reference`).

    positions, groups: [B, S] (−1 = padding / text); full, sliding: {"kv_pos", "kv_group"}
    [B, T] of the keys each layer type attends over, and "cache_rows" [B] where those keys are
    a continuous-batching cache's slots (`linear_memory`) → {layer type: kwargs}. Sliding layers
    get the window and, with bidirectional_vision, the vision runs; full layers are causal only.
    """
    args = {
        FULL: dict(q_pos=positions, kv_pos=full["kv_pos"]),
        SLIDING: dict(
            q_pos=positions, kv_pos=sliding["kv_pos"], sliding_window=config.sliding_window
        ),
    }
    if config.bidirectional_vision:
        args[SLIDING].update(q_group=groups, kv_group=sliding["kv_group"])
    for kind, keys in ((FULL, full), (SLIDING, sliding)):
        if "cache_rows" in keys:
            args[kind]["cache_rows"] = keys["cache_rows"]
    return args


def _project(x, name, features):
    return linear(x, Weight((features, x.shape[-1]), name=name)())


class Attention(nn.Module):
    """Gemma4TextAttention over the KV cache: q/k norms, RoPE, v_norm, scale 1."""

    config: TextConfig
    layer: int

    @nn.compact
    def __call__(self, x, positions, kv, mask_args, attention, write):
        """x: [B, S, D]; positions: [B, S]; kv: this layer's cache (k, v), or a KV-sharing
        consumer's producer's keys/values as the producer attended to them; write(kv, k, v)
        [B, Hkv, S, hd] → (stored cache, keys/values to attend to: [B, Hkv, T, hd], or a
        continuous-batching cache's F slots read at mask_args' cache_rows)
        → (out [B, S, D], stored cache or None, attended (k, v))."""
        c, i = self.config, self.layer
        b, s, _ = x.shape
        hd, heads, kv_heads = c.head_dims[i], c.num_attention_heads, c.kv_heads[i]
        inv_freq = rope_inv_freq(c.rope_for(c.layer_types[i]), hd)
        q = _project(x, "q_proj", heads * hd).reshape(b, s, heads, hd)
        q = apply_rope(RMSNorm(c.rms_norm_eps, name="q_norm")(q), positions, inv_freq)
        stored = None
        if not c.shares_kv(i):
            k = _project(x, "k_proj", kv_heads * hd).reshape(b, s, kv_heads, hd)
            # attention_k_eq_v: full layers have no v_proj; values are the raw key projection
            k_eq_v = c.attention_k_eq_v and c.layer_types[i] == FULL
            v = k if k_eq_v else _project(x, "v_proj", kv_heads * hd).reshape(b, s, kv_heads, hd)
            k = apply_rope(RMSNorm(c.rms_norm_eps, name="k_norm")(k), positions, inv_freq)
            v = rms_norm(v, None, c.rms_norm_eps)
            stored, kv = write(kv, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
        out = attention(jnp.swapaxes(q, 1, 2), kv[0], kv[1], **mask_args, scale=1.0)
        out = jnp.swapaxes(out, 1, 2).reshape(b, s, heads * hd)
        return _project(out, "o_proj", c.hidden_size), stored, kv


class MLP(nn.Module):
    """Gemma4TextMLP: `down(gelu_tanh(gate(x)) · up(x))`. x: [..., D] → [..., D]."""

    config: TextConfig
    layer: int

    @nn.compact
    def __call__(self, x):
        c = self.config
        # use_double_wide_mlp doubles the MLP of KV-sharing layers only
        wide = 2 if c.use_double_wide_mlp and c.shares_kv(self.layer) else 1
        inter = c.intermediate_size * wide
        return gated_mlp(
            x,
            partial(_project, name="gate_proj", features=inter),
            partial(_project, name="up_proj", features=inter),
            partial(_project, name="down_proj", features=c.hidden_size),
        )


class DecoderLayer(nn.Module):
    """Gemma4TextDecoderLayer: sandwich norms, MLP (+ MoE, its experts run in `moe`: a
    `ref.moe_modes.MoeMode`), per-layer input, layer scalar."""

    config: TextConfig
    layer: int
    moe: MoeMode = MoeMode()

    @nn.compact
    def __call__(self, x, per_layer_input, positions, kv, mask_args, attention, write):
        """x: [B, S, D]; per_layer_input: [B, S, P] or None; the rest as `Attention`
        → (x [B, S, D], stored cache or None, attended (k, v))."""
        c = self.config
        norm = partial(RMSNorm, c.rms_norm_eps)
        h, stored, kv = Attention(c, self.layer, name="self_attn")(
            norm(name="input_layernorm")(x), positions, kv, mask_args, attention, write
        )
        x = x + norm(name="post_attention_layernorm")(h)
        h = MLP(c, self.layer, name="mlp")(norm(name="pre_feedforward_layernorm")(x))
        if c.enable_moe_block:
            flat = x.reshape(-1, c.hidden_size)
            weights, index = Router(c, name="router")(flat)
            moe = Experts(c, self.moe, name="experts")(
                norm(name="pre_feedforward_layernorm_2")(flat), weights, index
            )
            moe = norm(name="post_feedforward_layernorm_2")(moe.reshape(x.shape))
            h = norm(name="post_feedforward_layernorm_1")(h) + moe
        x = x + norm(name="post_feedforward_layernorm")(h)
        if c.hidden_size_per_layer_input:
            h = gelu_tanh(_project(x, "per_layer_input_gate", c.hidden_size_per_layer_input))
            h = _project(h * per_layer_input, "per_layer_projection", c.hidden_size)
            x = x + norm(name="post_per_layer_input_norm")(h)
        scalar = self.param("layer_scalar", nn.initializers.ones, (1,))
        return x * scalar.astype(x.dtype), stored, kv


class Layers(nn.Module):
    """`layers`: decoder layers named "0", "1", … as in the checkpoint.

    __call__(x [B, S, D], per_layer [B, S, L, P] or None, positions [B, S], keys, values
    ({layer: [B, Hkv, T, hd]} of the cache-owning layers), and per layer type: mask_args,
    write (see `Attention`); attention) → (x, keys, values, hidden_states: the input then
    every layer's output, or () unless keep_states: an eager caller holds each layer's output
    for the whole step otherwise, 21 MiB per 31B layer at 1,024 tokens); moe: how the
    experts run (`ref.moe_modes.MoeMode`).
    """

    config: TextConfig
    keep_states: bool = True
    moe: MoeMode = MoeMode()

    @nn.compact
    def __call__(self, x, per_layer, positions, keys, values, mask_args, writes, attention):
        c = self.config
        keys, values = dict(keys), dict(values)
        # what each producer attended to, kept for its consumers only (held for the rest of
        # the step otherwise: a 31B decode at ctx 65,536 held 1.6 GB of sliding layers' keys)
        attended = {}
        shared = {c.kv_source[i] for i in range(c.num_hidden_layers) if c.shares_kv(i)}
        states = [x] if self.keep_states else None
        for i in range(c.num_hidden_layers):
            src, kind = str(c.kv_source[i]), c.layer_types[i]
            kv = attended[src] if c.shares_kv(i) else (keys[src], values[src])
            x, stored, kv = DecoderLayer(c, i, self.moe, name=str(i))(
                x,
                None if per_layer is None else per_layer[:, :, i],
                positions,
                kv,
                mask_args[kind],
                attention,
                writes[kind],
            )
            if stored is not None:
                keys[src], values[src] = stored
                if int(src) in shared:
                    attended[src] = kv
            if states is not None:
                states.append(x)
        return x, keys, values, () if states is None else tuple(states)


class TextModel(nn.Module):
    """Gemma4TextModel (the checkpoint's `model.language_model`), one step over the cache.

    __call__(input_ids [B, S], positions [B, S] (−1 = padding), cache (see
    `ref.gemma4.kv_cache.init_cache`), vision_embeds [B, V, D] (the soft tokens of the row's
    image, video and audio placeholders, in order) or None, image_idx [B, 1] or None,
    attention, slots: None, or [B] int (continuous batching: "k" and "v" hold F ≥ B slots and
    row b reads and writes slot slots[b] only, −1 = none; the cache's other arrays
    are the step's B rows), key_len: None, or a compute context length K (an int or an
    exporter's symbol, above every position of the step): layers that read the cache by
    position attend to its first K slots only (`linear_memory`); a sliding ring reads its W
    slots as always) → {"hidden": [B, S, D] after the final norm, "cache", "image_idx":
    image_idx_output (with vision_embeds), "hidden_states": the merged embeddings then every
    layer's output, each [B, S, D], when keep_states} (the keys `VisionModel` uses where they
    mean the same). moe: how the experts run (`ref.moe_modes.MoeMode`).
    """

    config: TextConfig
    keep_states: bool = True
    moe: MoeMode = MoeMode()

    @nn.compact
    def __call__(
        self, input_ids, positions, cache, vision_embeds, image_idx, attention, slots=None,
        key_len=None,
    ):  # fmt: skip
        c = self.config
        # image, video and audio tokens alike take soft tokens from vision_embeds, in order
        placeholder, vision = placeholder_masks(input_ids, c)
        ids = embedding_ids(input_ids, placeholder, c.pad_token_id)
        x = Embedding(c.vocab_size, c.hidden_size, c.hidden_size**0.5, name="embed_tokens")(ids)
        # decode steps (no vision_embeds) merge nothing and open no vision run
        is_vision = jnp.zeros(input_ids.shape, bool)
        image_idx_out = None
        if vision_embeds is not None:
            valid = positions >= 0
            left = within_stream(placeholder & valid, vision_embeds.shape[1], image_idx)
            x, image_idx_out = merge_vision(x, left, vision_embeds, image_idx)
            is_vision = vision & left
        per_layer = self._per_layer_inputs(ids, x) if c.hidden_size_per_layer_input else None

        groups = vision_runs(is_vision, positions, cache.get("group"))
        cache, full, full_write = linear_memory(cache, positions, groups, slots, key_len)
        sliding, sliding_write = full, full_write
        if uses_ring(c, cache):
            ring = ring_len(c, cache)
            cache, sliding, sliding_write = ring_memory(cache, positions, groups, ring, slots)
        mask_args = layer_mask_args(c, positions, groups, full, sliding)
        writes = {FULL: full_write, SLIDING: sliding_write}

        x, keys, values, states = Layers(c, self.keep_states, self.moe, name="layers")(
            x, per_layer, positions, cache["k"], cache["v"], mask_args, writes, attention
        )
        out = {
            "hidden": RMSNorm(c.rms_norm_eps, name="norm")(x),
            "cache": dict(cache, k=keys, v=values),
        }
        if self.keep_states:
            out["hidden_states"] = states
        if image_idx_out is not None:
            out["image_idx"] = image_idx_out
        return out

    def _per_layer_inputs(self, ids, embeds):
        """Per-layer embeddings (PLE): token identity plus a projection of the embeddings.

        ids: [B, S]; embeds: [B, S, D] (images merged) → [B, S, L, P].
        """
        c = self.config
        n, p = c.num_hidden_layers, c.hidden_size_per_layer_input
        table = Embedding(
            c.vocab_size_per_layer_input, n * p, p**0.5, name="embed_tokens_per_layer"
        )
        token = table(ids).reshape(*ids.shape, n, p)
        proj = _project(embeds, "per_layer_model_projection", n * p) * (c.hidden_size**-0.5)
        proj = proj.reshape(*ids.shape, n, p)
        proj = RMSNorm(c.rms_norm_eps, name="per_layer_projection_norm")(proj)
        return (proj + token) * (2.0**-0.5)
