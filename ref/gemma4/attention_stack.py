"""A stack of Gemma 4 text attention layers over retained KV caches, for attention-kernel work.

Each layer is `h + self_attn(h)` with `ref.gemma4.text.Attention` itself (the decoder's norms
and MLP around it left out): what a kernel author compiles to study one blocking mode on the
model's real attention (q/k/v norms, per-type RoPE, scale 1, k_eq_v, window, vision runs).
The cache is QAIC's retained state: keys and values only, slot = position.
"""

from functools import partial

import flax.linen as nn
import jax.numpy as jnp

from ref import attention, cache
from ref.blocking import BlockingConfig
from ref.gemma4 import text as T
from ref.gemma4.text_config import TextConfig


class AttentionLayer(nn.Module):
    """`layers.{i}`: Gemma 4's text attention over this layer's own KV cache, plus the residual.

    The attention is `ref.gemma4.text.Attention` (as `self_attn`); this module only chooses its
    cache write (`ref.cache.update`, slot = position), its mask arguments
    (`ref.gemma4.text.layer_mask_args`) and its kernel (`ref.attention.blocked` in one mode, or
    the dense `reference` when `blocking` is None).
    """

    config: TextConfig
    layer: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, past_key, past_value, *group_ids):
        """h: [B, S, D]; position_ids: [B, S] (−1 = padding); past_*: [B, Hkv, T, hd] (or
        [1, B·Hkv, T, hd] with batch_fold); group_ids: ([B, S] vision-run ids, −1 = text) iff
        the config's vision runs are bidirectional → (h [B, S, D], key, value like past_*)."""
        c, b = self.config, h.shape[0]
        fold = self.blocking is not None and self.blocking.batch_fold
        if fold:
            past_key, past_value = cache.unfold(past_key, b), cache.unfold(past_value, b)
        kv_pos = cache.causal_positions(position_ids, past_key.shape[2])
        groups = group_ids[0] if group_ids else None
        # Only this call's run ids matter: every cached key of an earlier call sits at a
        # smaller position than all of this call's queries, so it is visible causally anyway.
        kv_group = None
        if groups is not None:  # jnp.full, not full_like: no [B, T] constant in an export
            kv_group = cache.scatter_positions(
                jnp.full(kv_pos.shape, -1, kv_pos.dtype), groups, position_ids
            )
        seen = {"kv_pos": kv_pos, "kv_group": kv_group}
        mask_args = T.layer_mask_args(c, position_ids, groups, seen, seen)
        kernel = attention.reference
        if self.blocking is not None:
            kernel = partial(attention.blocked, config=self.blocking)

        def write(kv, k, v):
            stored = cache.update(*kv, k, v, position_ids)
            return stored, tuple(cache.fold(x) for x in stored) if fold else stored

        out, (key, value), _ = T.Attention(c, self.layer, name="self_attn")(
            h,
            position_ids,
            (past_key, past_value),
            mask_args[c.layer_types[self.layer]],
            kernel,
            write,
        )
        if fold:
            key, value = cache.fold(key), cache.fold(value)
        return h + out, key, value


class AttentionLayers(nn.Module):
    """`model.language_model.layers`: the first n layers, each with its own retained KV cache."""

    config: TextConfig
    n: int
    blocking: BlockingConfig | None

    @nn.compact
    def __call__(self, h, position_ids, caches, group_ids):
        """caches: (key, value) per layer; group_ids: () or ([B, S],) → (h, new caches)."""
        new = []
        for i in range(self.n):
            layer = AttentionLayer(self.config, i, self.blocking, name=str(i))
            h, key, value = layer(h, position_ids, *caches[i], *group_ids)
            new.append((key, value))
        return h, tuple(new)
