"""Gemma 4's multi-token-prediction drafter (`Gemma4AssistantForCausalLM`, transformers'
gemma4_assistant; `google/gemma-4-*-it-assistant`) as Flax modules with the checkpoint's names.
The 12B Unified's (`Gemma4UnifiedAssistantForCausalLM`, gemma4_unified_assistant) is the same
model under another config (`KINDS`: a gemma4_unified_text decoder, backbone 3840 by default).

One draft step: `pre_projection(cat(target's scaled embedding of the last token, h))`, then
decoder layers whose attention has queries only (q_proj, q_norm, RoPE at the round's position,
o_proj) over the target's keys and values of the last non-shared layer of each attention type
(`shared_layers`), bidirectional over the positions before the query (a sliding layer over the
W + 1 positions before it: transformers' bidirectional window, distance ≤ W, looking back),
the final norm, and two results: the logits (the tied head, or with `use_ordered_embeddings`
the centroid head, `centroid_logits`) and `post_projection` of the normed state, the next
step's h. The first step's h is the target's final-norm hidden state at the position that
chose the last token.

Which target keys a draft reads: those at positions before the query (`draft_keys`). In a round
after the first, transformers' candidate generator slices the target's outputs to the current
length, so its drafter also sees the rejected draft's key at the query's own position, and in
sliding layers the rejected drafts' keys up to the round's end (docs/codegen.md); here a draft
reads only accepted tokens' keys, as transformers' first round does.
"""

import dataclasses
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from ref.attention import reference
from ref.gemma4.text import DecoderLayer
from ref.gemma4.text_config import FULL, SLIDING, TextConfig
from ref.gemma4.tower import checkpoint_loader
from ref.gemma4.unified_config import TEXT_DEFAULTS
from ref.layers import Embedding, RMSNorm, Weight, linear

DEFAULT_DRAFTS = 4  # drafts per round when neither the caller nor generation_config names it
# model_type → (backbone_hidden_size's default, its text_config's defaults that differ from
# Gemma4TextConfig's): Gemma4AssistantConfig's, Gemma4UnifiedAssistantConfig's (a
# gemma4_unified_text decoder over the 12B Unified's keys; the same modules otherwise)
KINDS = {
    "gemma4_assistant": (1536, {}),
    "gemma4_unified_assistant": (
        3840,
        dict(TEXT_DEFAULTS, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
    ),
}


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """The drafter's hyper-parameters (hashable: jit-static): its decoder (`text`: every layer
    reads the target's keys, `kv_source` −1), the target's hidden size, the centroid head's
    sizes (ordered_embeddings), generation_config's `num_assistant_tokens` (None: absent),
    and whether the head is the drafter's `model.embed_tokens` (tied) or its `lm_head`."""

    text: TextConfig
    backbone_hidden_size: int
    ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32
    num_assistant_tokens: int | None = None
    tied: bool = True

    @classmethod
    def from_hf(cls, config, generation_config=None):
        """From a Gemma4AssistantConfig or Gemma4UnifiedAssistantConfig dict (config.json) and
        its generation_config.json dict; ValueError for what transformers' gemma4_assistant
        `validate_architecture` refuses (the unified one has no such check, but a layer with
        keys of its own is no drafter here: refused alike)."""
        kind = config.get("model_type") if isinstance(config, dict) else None
        if kind not in KINDS or not isinstance(config.get("text_config"), dict):
            raise ValueError(
                f"model_type={kind!r}: expected a 'gemma4_assistant' or "
                "'gemma4_unified_assistant' config with a text_config"
            )
        backbone, defaults = KINDS[kind]
        text = {**defaults, **config["text_config"]}
        n = int(text.get("num_hidden_layers", 30))
        for key, want in (("hidden_size_per_layer_input", 0), ("vocab_size_per_layer_input", 0),
                          ("enable_moe_block", False), ("use_double_wide_mlp", False)):  # fmt: skip
            if (text.get(key) or 0) != want:
                raise ValueError(f"text_config.{key}={text.get(key)!r}: an assistant has {want}")
        shared = text.get("num_kv_shared_layers") or 0  # Gemma4(Unified)TextConfig's default
        if shared != n:
            raise ValueError(
                f"text_config.num_kv_shared_layers={shared}: every assistant layer reads the "
                f"target's keys (expected {n})"
            )
        resolved = TextConfig.from_hf(dict(text, num_kv_shared_layers=0))
        resolved = dataclasses.replace(resolved, kv_source=(-1,) * n)
        drafts = (generation_config or {}).get("num_assistant_tokens")
        top_k, centroids = (
            config.get("centroid_intermediate_top_k", 32),
            config.get("num_centroids", 2048),
        )
        out = cls(resolved, int(config.get("backbone_hidden_size", backbone)),
                  bool(config.get("use_ordered_embeddings", False)), int(centroids), int(top_k),
                  None if drafts is None else int(drafts),
                  bool(config.get("tie_word_embeddings", True)))  # fmt: skip
        if out.ordered_embeddings and resolved.vocab_size % out.num_centroids:
            raise ValueError(f"vocab_size={resolved.vocab_size} is not a multiple of "
                             f"num_centroids={out.num_centroids}")  # fmt: skip
        return out


def shared_layers(target):
    """{layer type: the target's last layer of that type that computes its own keys} (a
    `TextConfig`): the layers whose keys and values the drafter reads (transformers'
    `kv_sharing_modes` "store")."""
    return {
        kind: max(
            i for i, t in enumerate(target.layer_types) if t == kind and not target.shares_kv(i)
        )
        for kind in sorted(set(target.layer_types))
    }


def draft_keys(keys, values, kv_pos, position):
    """One layer type's keys as a draft at `position` reads them: (k, v [B, Hkv, T, hd],
    kv_pos [B, T] with every slot at or after the query's position marked empty (−1))."""
    return keys, values, jnp.where((kv_pos >= 0) & (kv_pos < position), kv_pos, -1)


class _Layers(nn.Module):
    """`model.layers`: the drafter's decoder layers named "0", "1", … over the target's keys."""

    config: TextConfig

    @nn.compact
    def __call__(self, x, positions, keys):
        c = self.config
        for i in range(c.num_hidden_layers):
            kind = c.layer_types[i]
            k, v, kv_pos, rows = keys[kind]
            args = dict(q_pos=positions, kv_pos=kv_pos)
            if rows is not None:  # continuous batching: row b reads cache slot rows[b]
                args["cache_rows"] = rows
            if kind == SLIDING:  # W + 1 keys before the query: |q − k| ≤ W, looking back
                args["sliding_window"] = c.sliding_window + 2
            x, _, _ = DecoderLayer(c, i, name=str(i))(x, None, positions, (k, v), args,
                                                      reference, None)  # fmt: skip
        return x


class _Body(nn.Module):
    """`model`: the layers and the final norm → (normed [B, S, D], `embed_tokens` [V, D], the
    drafter's own table, read only as its tied head)."""

    config: TextConfig

    @nn.compact
    def __call__(self, x, positions, keys):
        c = self.config
        x = _Layers(c, name="layers")(x, positions, keys)
        table = Weight((c.vocab_size, c.hidden_size), name="embed_tokens")()
        return RMSNorm(c.rms_norm_eps, name="norm")(x), table


class _Centroids(nn.Module):
    """`masked_embedding`: the centroid head's parameters → `centroid_logits`."""

    config: AssistantConfig

    @nn.compact
    def __call__(self, hidden, head):
        c = self.config
        weight = Weight((c.num_centroids, c.text.hidden_size), name="centroids")()
        ordering = self.param("token_ordering", nn.initializers.zeros, (c.text.vocab_size,),
                              jnp.int32)  # fmt: skip
        return centroid_logits(hidden, head, weight, ordering, c.centroid_top_k)


class Assistant(nn.Module):
    """Gemma4AssistantForCausalLM, one draft step (see the module).

    __call__(embeds [B, S, Db]: the target's scaled embedding of the last token, h [B, S, Db],
    positions [B, S], keys {layer type: (k, v [F, Hkv, T, hd], kv_pos [B, T], rows: None (F =
    B) or [B] int, the cache slot each row reads)} (`speculative.drafter_keys`))
    → {"logits": [B, S, V] float32, "hidden": [B, S, D] after the final norm, "projected":
    [B, S, Db], the next step's h}."""

    config: AssistantConfig

    @nn.compact
    def __call__(self, embeds, h, positions, keys):
        c = self.config
        d = c.text.hidden_size
        x = linear(jnp.concatenate([embeds, h.astype(embeds.dtype)], axis=-1),
                   Weight((d, 2 * c.backbone_hidden_size), name="pre_projection")())  # fmt: skip
        hidden, head = _Body(c.text, name="model")(x, positions, keys)
        projected = linear(hidden, Weight((c.backbone_hidden_size, d), name="post_projection")())
        if not c.tied:
            head = Weight((c.text.vocab_size, d), name="lm_head")()
        if c.ordered_embeddings:
            logits = _Centroids(c, name="masked_embedding")(hidden, head)
        else:
            logits = linear(hidden, head)
        return {"logits": logits.astype(jnp.float32), "hidden": hidden, "projected": projected}


def centroid_logits(hidden, head, centroids, ordering, top_k):
    """The ordered-embedding head (`Gemma4AssistantMaskedEmbedder`): the `top_k` centroids of
    `hidden` each own V/C token ids (`ordering` [V] read as [C, V/C]); those ids get
    `hidden · head[id]`, every other id the least of those over the whole batch less 1.

    hidden: [B, S, D]; head: [V, D]; centroids: [C, D] → [B, S, V]."""
    b, s, _ = hidden.shape
    v, c = head.shape[0], centroids.shape[0]
    _, top = lax.top_k(linear(hidden, centroids), top_k)  # [B, S, k]
    ids = ordering.astype(jnp.int32).reshape(c, v // c)[top].reshape(b, s, -1)
    rows_of = head.astype(hidden.dtype)[ids]  # [B, S, k·V/C, D]
    chosen = jnp.matmul(rows_of, hidden[..., None])[..., 0]  # a matmul: no Einsum on QAIC
    filled = jnp.full((b, s, v), jnp.min(chosen) - 1.0, chosen.dtype)
    rows = jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None]
    # ids are in [0, V) (a permutation's rows): no bounds mask, so no NonZero in an export
    return filled.at[rows[0], rows[1], ids].set(chosen, mode="promise_in_bounds")


class _TargetEmbedding(nn.Module):
    """The target's `embed_tokens` (`ref.layers.Embedding`, the module the target's own step
    uses, so a reader of its table by rows sees the drafter's reads too)."""

    hidden_size: int

    @nn.compact
    def __call__(self, ids, vocab):
        return Embedding(vocab, self.hidden_size, self.hidden_size**0.5, name="embed_tokens")(ids)


def target_embedding(params, ids, hidden_size):
    """The target's scaled token embedding (`Gemma4TextScaledWordEmbedding`, as
    `ref.layers.Embedding` computes it) of ids [B, S] → [B, S, D] (params: its
    `model.language_model` tree)."""
    table = params["embed_tokens"]["weight"]
    return _TargetEmbedding(hidden_size).apply({"params": {"embed_tokens": {"weight": table}}},
                                               ids, table.shape[0])  # fmt: skip


def param_shapes(config):
    """{checkpoint name: shape} of a drafter's parameters (an `AssistantConfig`)."""
    t = config.text
    b = 1
    keys = {}
    for kind in sorted(set(t.layer_types)):
        i = t.layer_types.index(kind)
        k = jnp.zeros((b, t.kv_heads[i], 2, t.head_dims[i]))
        keys[kind] = (k, k, jnp.zeros((b, 2), jnp.int32), None)
    x = jnp.zeros((b, 1, config.backbone_hidden_size))
    at = jnp.zeros((b, 1), jnp.int32)
    tree = jax.eval_shape(lambda: Assistant(config).init(jax.random.PRNGKey(0), x, x, at, keys))
    flat = jax.tree_util.tree_flatten_with_path(tree["params"])[0]
    return {".".join(p.key for p in path): tuple(leaf.shape) for path, leaf in flat}


@partial(jax.jit, static_argnames=("config",))
def _draft_step(params, embeds, h, positions, keys, *, config):
    return Assistant(config).apply({"params": params}, embeds, h, positions, keys)


@dataclasses.dataclass
class AssistantModel:
    """A drafter as loaded: its `AssistantConfig` and checkpoint tree (floats in `dtype`,
    token_ordering int32)."""

    config: AssistantConfig
    params: dict

    @classmethod
    def from_params(cls, hf_config, params, generation_config=None, dtype=jnp.float32):
        """From config.json's dict, the checkpoint tree and generation_config.json's dict (its
        num_assistant_tokens)."""
        config = AssistantConfig.from_hf(hf_config, generation_config)

        def cast(x):
            x = jnp.asarray(x)
            return x.astype(jnp.int32) if x.dtype.kind in "iu" else x.astype(dtype)

        return cls(config, jax.tree_util.tree_map(cast, params))

    @classmethod
    def from_pretrained(cls, model_dir, generation_config=None, dtype=jnp.float32):
        """From an HF assistant folder, read by the `weights` package's loader;
        generation_config: its generation_config.json as a dict
        (`weights.generation_config(model_dir)`), or None."""
        hf_config, params = checkpoint_loader()(model_dir, lazy=False)
        return cls.from_params(hf_config, params, generation_config, dtype)

    def apply(self, embeds, h, positions, keys):
        """`Assistant` on these parameters, compiled once per config."""
        return _draft_step(self.params, embeds, h, positions, keys, config=self.config)


__all__ = ["FULL", "SLIDING", "Assistant", "AssistantConfig", "AssistantModel", "centroid_logits"]
