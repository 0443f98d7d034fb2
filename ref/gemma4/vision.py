"""The packed Gemma 4 vision tower as Flax Linen modules over pure functions.

Module and parameter names are the Hugging Face checkpoint's own (`encoder.layers.0.self_attn.
q_proj.linear.weight`, …), weights keep the `[out, in]` layout, so the subtree of a checkpoint
under `model.vision_tower` is this model's `params` as it is.

Attention runs over the packed sequence in one of two equal ways: `cu_seqlens` given (a static
tuple) computes each item's attention on its own slice — exact block-diagonal work, what a
varlen kernel does, query tiles in a `lax.map`, each online over KV tiles (not exportable: that
path is for running);
otherwise masks over `segment_ids` (static shapes, what a fixed-budget export computes), query
tile × KV tile with the online-softmax state (`tiled_packed_attention`; `tiles` (1, 1) is the
dense mask).

Tiled attention: a dense segment mask over a packed sequence of N patches holds H·N² scores at
once (16 heads × 10080² floats at budget 1120: 6.5 GB). Each query tile runs through the KV
tiles in turn, carrying the state (m, l, O) of `ref.online_softmax`, so the scores of one tile,
[H, N/q_tiles, N/kv_tiles], are live at a time. The loops are unrolled in Python over static
bounds (an export has no Loop op); the bounds are expressions of N, so a symbolic N traced for
export stays symbolic. Each tile's mask comes from `segment_ids` (data): a patch attends to the
patches of its own item, filler (−1) attends to nothing and gets zeros.
"""

import math
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ref import online_softmax
from ref.gemma4.config import VisionConfig
from ref.layers import RMSNorm, Weight, clipped_linear, gated_mlp, linear, rms_norm
from ref.rope import axial_rope

_CLIP_NAMES = ("input_min", "input_max", "output_min", "output_max")


# --- packed attention tile by tile (the exported path) ---------------------------------------


def segment_mask(q_ids, kv_ids):
    """Same item and not filler: q_ids [S], kv_ids [T] int → [S, T] bool."""
    return (q_ids[:, None] == kv_ids[None, :]) & (q_ids[:, None] >= 0)


def tile_bounds(n, tiles):
    """`tiles` [start, end) bounds of n // tiles rows over [0, n), the last one ending at n (it
    takes the remainder where tiles does not divide n); n may be a symbolic dimension."""
    size = n // tiles
    return [(i * size, n if i == tiles - 1 else (i + 1) * size) for i in range(tiles)]


def check_tiles(tiles, n):
    """(query tiles, KV tiles) as ints ≥ 1, each at most n when n is concrete; ValueError
    naming the bad value otherwise."""
    if not isinstance(tiles, tuple) or len(tiles) != 2:
        raise ValueError(f"tiles {tiles!r}: expected a pair (query tiles, KV tiles)")
    for name, t in zip(("query", "KV"), tiles, strict=True):
        if not isinstance(t, int) or isinstance(t, bool) or t < 1:
            raise ValueError(f"{name} tiles {t!r}: expected an int >= 1")
        if isinstance(n, int) and t > n:
            raise ValueError(f"{name} tiles {t}: more than the {n} patches")
    return tiles


def _slice(x, bounds, axis):
    return lax.slice_in_dim(x, bounds[0], bounds[1], axis=axis)


def tiled_packed_attention(q, k, v, segment_ids, tiles=(1, 1)):
    """Bidirectional attention inside each packed item, scale 1, tile by tile.

    q: [N, H, D]; k, v: [N, Hkv, D] (kv head j serves query heads j·g … j·g+g−1);
    segment_ids: [N] int (−1 = filler); tiles: (query tiles, KV tiles) → [N, H, D].
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {hkv}")
    q_tiles, kv_tiles = check_tiles(tiles, n)
    q5 = jnp.swapaxes(q, 0, 1).reshape(1, hkv, h // hkv, n, d)
    kh, vh = jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None]
    kv = [
        (_slice(kh, b, 2), _slice(vh, b, 2), _slice(segment_ids, b, 0))
        for b in tile_bounds(n, kv_tiles)
    ]
    outs, last = [], None
    for bounds in tile_bounds(n, q_tiles):
        qt, q_ids, state = _slice(q5, bounds, 3), _slice(segment_ids, bounds, 0), None
        for kt, vt, kv_ids in kv:
            if last is not None:
                # The tile's queries and mask depend on the tile before (`after`, exact), as in
                # `ref.attention.blocked(ordered=True)`: otherwise a runtime may make every
                # tile's scores or mask first (onnxruntime did: 9×9 peaked as dense).
                qt, q_ids = online_softmax.after(last, qt, q_ids)
            mask = segment_mask(q_ids, kv_ids)
            state = last = online_softmax.step(state, qt, kt, vt, mask, scale=1.0, softcap=None)
        outs.append(online_softmax.finish(state, q.dtype))
    # lax.concatenate: jax2onnx's jnp.concatenate declares a wrong size along a symbolic axis.
    out = outs[0] if len(outs) == 1 else lax.concatenate(outs, 3)
    return jnp.swapaxes(out.reshape(h, n, d), 0, 1)


# --- the tower ----------------------------------------------------------------------------


# Tiles of the per-item path. Each query tile runs through the item's keys KEY_TILE at a time with
# the online-softmax state (`ref.online_softmax.step`), so one block of scores [H, QUERY_TILE,
# KEY_TILE] (6 MB) is live, not [H, QUERY_TILE, n] (0.5 GB at n = 10080): the softmax passes stay
# off the memory bus. Measured on a 10080-patch item (12 heads × 64, 2-core CPU): quiet,
# 2.0 s, as fast as full rows of 1024 queries; with other jobs loading the machine, 3.4 CPU-s
# against 5.6. Query tiles of 512–4096 with key tiles of 64–256 are within 10 % (2048 looked
# ~7 % faster, inside the noise; 1024 keeps the tests' multi-tile item small).
QUERY_TILE = 1024
KEY_TILE = 128


def _heads_first(x):
    """[n, H, D] → [1, H, n, D]."""
    return jnp.swapaxes(x, 0, 1)[None]


def _stacked_tiles(x, size, axis):
    """The full tiles of `size` rows along `axis`, stacked in front, and the remaining rows.

    x: [..., n, ...] → ([n // size, ..., size, ...] or None, [..., n % size, ...] or None).
    """
    n = x.shape[axis]
    count, rest = divmod(n, size)
    full = None
    if count:
        head = jax.lax.slice_in_dim(x, 0, count * size, axis=axis)
        full = jnp.moveaxis(
            head.reshape(*x.shape[:axis], count, size, *x.shape[axis + 1 :]), axis, 0
        )
    return full, (jax.lax.slice_in_dim(x, count * size, n, axis=axis) if rest else None)


def _query_tile(qt, k_tiles, k_rest, v_tiles, v_rest):
    """One query tile against all of an item's keys, KEY_TILE keys per online-softmax step.

    qt: [1, Hkv, g, S, D]; k_tiles, v_tiles: [T, 1, Hkv, KEY_TILE, D] or None; k_rest, v_rest:
    [1, Hkv, r, D] or None → [1, Hkv, g, S, D].
    """
    step = partial(online_softmax.step, mask=True, scale=1.0, softcap=None)
    state = None
    if k_tiles is not None:
        state = step(None, qt, k_tiles[0], v_tiles[0])
        state, _ = jax.lax.scan(
            lambda s, kv: (step(s, qt, *kv), None), state, (k_tiles[1:], v_tiles[1:])
        )
    if k_rest is not None:
        state = step(state, qt, k_rest, v_rest)
    return online_softmax.finish(state, qt.dtype)


def item_attention(q, k, v):
    """Bidirectional attention over one item: query tiles of ≤ QUERY_TILE rows in sequence,
    each online over KV tiles of KEY_TILE keys.

    q: [n, H, D]; k, v: [n, Hkv, D] (kv head j serves query heads j·g … j·g+g−1) → [n, H, D].
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    keys = (
        *_stacked_tiles(_heads_first(k), KEY_TILE, 2),
        *_stacked_tiles(_heads_first(v), KEY_TILE, 2),
    )
    count = -(-n // QUERY_TILE)
    size = -(-n // count)
    grouped = _heads_first(q).reshape(1, hkv, h // hkv, n, d)
    padded = jnp.pad(grouped, ((0, 0),) * 3 + ((0, count * size - n), (0, 0)))
    tiles, _ = _stacked_tiles(padded, size, 3)
    out = jax.lax.map(lambda qt: _query_tile(qt, *keys), tiles)
    out = jnp.moveaxis(out, 0, 3).reshape(h, count * size, d)[:, :n]
    return jnp.swapaxes(out, 0, 1)


def packed_attention(q, k, v, segment_ids, cu_seqlens=None, tiles=(1, 1)):
    """Bidirectional attention inside each packed item, scale 1.

    q: [N, H, D]; k, v: [N, Hkv, D]; segment_ids: [N]; cu_seqlens: None or a static tuple of
    item offsets (the filler after the last offset gets zeros, as under the mask); tiles:
    (query tiles, KV tiles) of the masked path → [N, H, D].
    """
    if cu_seqlens is None:
        return tiled_packed_attention(q, k, v, segment_ids, tiles)
    parts = [
        item_attention(q[start:end], k[start:end], v[start:end])
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)
    ]
    filler = q.shape[0] - cu_seqlens[-1]
    if filler:
        parts.append(jnp.zeros((filler, *q.shape[1:]), q.dtype))
    return jnp.concatenate(parts, axis=0)


def pool(x, pool_index, scale):
    """Mean over each gathered k×k block, in (at least) float32, times `scale`.

    x: [N, D]; pool_index: [M, k²] → [M, D] float32 (float64 for float64 x).
    """
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return jnp.mean(x.astype(acc)[pool_index], axis=1) * jnp.asarray(scale, acc)


def patch_embed(patches, positions, input_proj, table):
    """`input_proj(2·(p − 0.5)) + table[0][x] + table[1][y]`.

    patches: [N, 3·p·p] in [0, 1]; positions: [N, 2] (x, y); input_proj: [D, 3·p·p];
    table: [2, P, D] → [N, D].
    """
    hidden = linear(2.0 * (patches - 0.5), input_proj)
    return hidden + (table[0][positions[:, 0]] + table[1][positions[:, 1]]).astype(hidden.dtype)


class ClippableLinear(nn.Module):
    """Gemma4ClippableLinear: `linear.weight` [out, in] plus four scalar bounds when clipped."""

    features: int
    clipped: bool

    @nn.compact
    def __call__(self, x):
        w = Weight((self.features, x.shape[-1]), name="linear")()
        bounds = None
        if self.clipped:
            bounds = tuple(
                self.param(n, lambda _key, n=n: jnp.float32(-jnp.inf if "min" in n else jnp.inf))
                for n in _CLIP_NAMES
            )
        return clipped_linear(x, w, bounds)


class Packed(nn.Module):
    """A module over the packed sequence, built from the config, cu_seqlens (per-item
    attention; None: the segment mask) and tiles (query tiles, KV tiles)."""

    config: VisionConfig
    cu_seqlens: tuple | None = None
    tiles: tuple = (1, 1)


class Attention(Packed):
    """Gemma4VisionAttention over a packed sequence: q/k norms, axial RoPE, scale 1."""

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        """x: [N, D]; positions: [N, 2]; segment_ids: [N] → [N, D]."""
        c = self.config
        hd, clip = c.head_dim, c.use_clipped_linears

        def project(name, heads):
            y = ClippableLinear(heads * hd, clip, name=name)(x)
            return y.reshape(x.shape[0], heads, hd)

        q = RMSNorm(c.rms_norm_eps, name="q_norm")(project("q_proj", c.num_attention_heads))
        k = RMSNorm(c.rms_norm_eps, name="k_norm")(project("k_proj", c.num_key_value_heads))
        v = rms_norm(project("v_proj", c.num_key_value_heads), None, c.rms_norm_eps)
        q = axial_rope(q, positions, c.rope_theta)
        k = axial_rope(k, positions, c.rope_theta)
        out = packed_attention(q, k, v, segment_ids, self.cu_seqlens, self.tiles)
        return ClippableLinear(c.hidden_size, clip, name="o_proj")(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    """Gemma4VisionMLP: `down(gelu_tanh(gate(x)) · up(x))` with clippable linears."""

    config: VisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        ffn, clip = c.intermediate_size, c.use_clipped_linears
        return gated_mlp(
            x,
            ClippableLinear(ffn, clip, name="gate_proj"),
            ClippableLinear(ffn, clip, name="up_proj"),
            ClippableLinear(c.hidden_size, clip, name="down_proj"),
        )


class EncoderLayer(Packed):
    """Sandwich-normed block: `h = x + post(attn(in(x)))`, `out = h + post(mlp(pre(h)))`."""

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        """x: [N, D]; positions: [N, 2]; segment_ids: [N] → [N, D]."""
        eps = self.config.rms_norm_eps
        h = RMSNorm(eps, name="input_layernorm")(x)
        attn = Attention(self.config, self.cu_seqlens, self.tiles, name="self_attn")
        h = attn(h, positions, segment_ids)
        x = x + RMSNorm(eps, name="post_attention_layernorm")(h)
        h = MLP(self.config, name="mlp")(RMSNorm(eps, name="pre_feedforward_layernorm")(x))
        return x + RMSNorm(eps, name="post_feedforward_layernorm")(h)


class Stack(Packed):
    """A Packed module that may hand back every layer's output (keep_states)."""

    keep_states: bool = True


class Layers(Stack):
    """`encoder.layers`: layers named "0", "1", … as in the checkpoint."""

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        """x: [N, D] → (x [N, D], hidden states: tuple of L+1 arrays [N, D], or () unless
        keep_states)."""
        states = [x] if self.keep_states else None
        for i in range(self.config.num_hidden_layers):
            layer = EncoderLayer(self.config, self.cu_seqlens, self.tiles, name=str(i))
            x = layer(x, positions, segment_ids)
            if states is not None:
                states.append(x)
        return x, () if states is None else tuple(states)


class PatchEmbedder(nn.Module):
    """`patch_embedder.input_proj.weight` and `patch_embedder.position_embedding_table`."""

    config: VisionConfig

    @nn.compact
    def __call__(self, patches, positions):
        """patches: [N, 3·p·p]; positions: [N, 2] → [N, D]."""
        c = self.config
        w = Weight((c.hidden_size, c.patch_dim), name="input_proj")()
        table = self.param(
            "position_embedding_table",
            nn.initializers.normal(0.02),
            (2, c.position_embedding_size, c.hidden_size),
        )
        return patch_embed(patches, positions, w, table)


class Encoder(Stack):
    """`encoder`: holds `layers`."""

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        layers = Layers(self.config, self.cu_seqlens, self.tiles, self.keep_states, name="layers")
        return layers(x, positions, segment_ids)


class VisionModel(Stack):
    """Gemma4VisionModel on a packed sequence.

    __call__(patches [N, 3·p·p], positions [N, 2], segment_ids [N], pool_index [M, k²]) →
    dict with "pooled" [M, D] (HF's last_hidden_state, in the input dtype) and
    "hidden_states" (embeddings then every layer's output, [N, D] each; () unless
    keep_states: an eager caller holds them all otherwise).
    """

    @nn.compact
    def __call__(self, patches, positions, segment_ids, pool_index):
        c = self.config
        x = PatchEmbedder(c, name="patch_embedder")(patches, positions)
        encoder = Encoder(c, self.cu_seqlens, self.tiles, self.keep_states, name="encoder")
        x, states = encoder(x, positions, segment_ids)
        pooled = pool(x, pool_index, math.sqrt(c.hidden_size))
        if c.standardize:
            bias = self.param("std_bias", nn.initializers.zeros, (c.hidden_size,))
            scale = self.param("std_scale", nn.initializers.ones, (c.hidden_size,))
            pooled = (pooled - bias.astype(pooled.dtype)) * scale.astype(pooled.dtype)
        return {"pooled": pooled.astype(x.dtype), "hidden_states": states}


class EmbedVision(nn.Module):
    """`embed_vision`: weightless RMSNorm, then `embedding_projection` to the text width.

    x: [M, D] → [M, text_hidden].
    """

    config: VisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.config
        if c.text_hidden_size is None:
            raise ValueError("embed_vision needs text_hidden_size: load a full Gemma 4 config")
        w = Weight((c.text_hidden_size, x.shape[-1]), name="embedding_projection")()
        return linear(rms_norm(x, None, c.rms_norm_eps), w)
