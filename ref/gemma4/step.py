"""One step of the Gemma 4 text decoder as callers run it: `apply_step` (the pure function
exporters trace: TextModel, then logits at every or each row's last position, soft-capped),
`step` (the same, compiled, after host checks of the concrete inputs), and the checks.

A step is a prefill chunk or a decode token over a position-indexed KV cache (`init_cache`);
with `batch_index` (continuous batching) each row reads and writes its own cache slot.
"""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ref import moe_modes, validate
from ref.attention import reference
from ref.cache import put_rows, take_rows
from ref.gemma4.kv_cache import cache_len, cache_view
from ref.gemma4.text import TextModel
from ref.layers import linear


class Logits(nn.Module):
    """The output head: `linear(hidden, weight)` in float32, soft-capped by `cap` (None: not).

    hidden: [..., D]; weight: [V, D] (lm_head, or embed_tokens when tied) → [..., V]. A module
    so that a caller may compute it its own way through `nn.intercept_methods` (verify's
    layer-by-layer check reads the weight a slice of the vocabulary at a time).
    """

    cap: float | None

    @nn.compact
    def __call__(self, hidden, weight):
        logits = linear(hidden, weight).astype(jnp.float32)
        if self.cap is not None:
            logits = jnp.tanh(logits / self.cap) * self.cap
        return logits


def check_step(config, cache, input_ids, position_ids, vision_embeds, image_idx):
    """Shape checks of one step's inputs (static: they run once per jit trace)."""
    if input_ids.ndim != 2 or position_ids.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {input_ids.shape} and position_ids {position_ids.shape}: "
            "expected both [batch, seq_len]"
        )
    b = input_ids.shape[0]
    ctx_len = cache_len(cache)
    cache_batch = {k.shape[0] for k in cache["k"].values()}
    if cache_batch != {b}:
        raise ValueError(f"cache batch {sorted(cache_batch)} != input batch {b}")
    if vision_embeds is None:
        if image_idx is not None:
            raise ValueError("image_idx given without vision_embeds")
        return
    want = (b, None, config.hidden_size)
    if vision_embeds.ndim != 3 or vision_embeds.shape[::2] != want[::2]:
        raise ValueError(
            f"vision_embeds {vision_embeds.shape}: expected [batch={b}, vision_size, "
            f"text_hidden={config.hidden_size}] (one row of soft tokens per batch row)"
        )
    # an exporter may trace vision_size as a symbol: one graph, a specialization per budget
    size = vision_embeds.shape[1]
    if isinstance(size, int) and not 0 < size < ctx_len:
        raise ValueError(
            f"vision_size={vision_embeds.shape[1]}: expected 0 < vision_size < ctx_len={ctx_len}"
        )
    if image_idx is None or image_idx.shape != (b, 1):
        shape = None if image_idx is None else image_idx.shape
        raise ValueError(f"image_idx {shape}: expected [batch={b}, 1] with vision_embeds")


def apply_step(
    params,
    lm_head,
    cache,
    input_ids,
    position_ids,
    vision_embeds=None,
    image_idx=None,
    batch_index=None,
    *,
    config,
    attention=reference,
    last_only=False,
    return_hidden=False,
    key_len=None,
    moe=None,
):
    """One prefill chunk or decode step of the Gemma 4 text decoder (greedy-ready logits).

    params: the checkpoint's `model.language_model` tree; lm_head: [V, D], or None when tied
    to embed_tokens; cache: see `init_cache` (ctx_len slots; keys and values may be held
    batch-folded, [1, B·Hkv, T, hd]: `kv_cache.unfolded`); input_ids, position_ids:
    [B, S] (position −1 = padding column: computes nothing useful, writes nothing);
    vision_embeds: [B, vision_size, D] soft tokens per row, its image, video and audio
    placeholders' in order (prefill), None to skip the merge (decode); image_idx: [B, 1] next
    unread soft token per row; attention: a function with
    `ref.attention.reference`'s signature (dense or blocked); batch_index: None, or [B, 1] int
    (continuous batching, QEfficient's `batch_index`): the cache holds F ≥ B slots and row b
    reads and writes slot batch_index[b] only (−1: a free row, whose writes are dropped);
    key_len: None, or a compute context length K in [1, ctx_len] above every position of the
    step (QEfficient's `comp_ctx_lengths`; an exporter may pass a symbol): the cache is written
    whole and attended over its first K slots (`ref.gemma4.kv_cache.linear_memory`); moe: how
    the experts run, None (dense), a `ref.moe_modes.MoeMode` or its text ("gather", "nsp:…").
    → {"logits": [B, S, V] float32 (or [B, 1, V] at each row's highest position when
    last_only), "hidden": the final norm's output the logits are made from ([B, S, D] or
    [B, 1, D]: what an MTP drafter reads), "cache", "image_idx": [B, 1] (with
    vision_embeds), "hidden_states" (return_hidden: embeddings then every layer's output,
    [B, S, D] each)}.
    """
    slots = None if batch_index is None else batch_index[:, 0]
    # continuous batching: the slots' records are taken here; each layer writes its keys and
    # values straight into its whole cache (`kv_cache.linear_memory`'s rows), where it is read
    records = {n: a for n, a in cache.items() if n not in ("k", "v")}
    seen = cache_view(config, cache)  # keys and values as [F, Hkv, T, hd], folded or not
    if slots is not None:
        seen = jax.eval_shape(take_rows, seen, slots)
        cache = dict(cache, **take_rows(records, slots))
    check_step(config, seen, input_ids, position_ids, vision_embeds, image_idx)
    model = TextModel(config, keep_states=return_hidden, moe=moe_modes.parse(moe)).apply(
        {"params": params}, input_ids, position_ids, cache, vision_embeds, image_idx, attention,
        slots, key_len,
    )  # fmt: skip
    if slots is not None:
        made = {n: model["cache"][n] for n in records}
        model["cache"] = dict(model["cache"], **put_rows(records, made, slots))
    hidden = model["hidden"]
    if last_only:
        last = jnp.argmax(position_ids, axis=1)[:, None, None]
        hidden = jnp.take_along_axis(hidden, last, axis=1)
    weight = params["embed_tokens"]["weight"] if lm_head is None else lm_head
    logits = Logits(config.final_logit_softcapping).apply({}, hidden, weight)
    out = {"logits": logits, "hidden": hidden, "cache": model["cache"]}
    if "image_idx" in model:
        out["image_idx"] = model["image_idx"]
    if return_hidden:
        out["hidden_states"] = model["hidden_states"]
    return out


# the compiled step; exporters trace `apply_step` (a jit would cache a trace made without them)
_compiled_step = jax.jit(
    apply_step,
    static_argnames=("config", "attention", "last_only", "return_hidden", "key_len", "moe"),
)


def check_key_len(key_len, position_ids, ctx_len):
    """key_len: None, or an int in [1, ctx_len] above every position of the step (concrete
    positions; a symbol passes: the runner of its specialization keeps the rule)."""
    if key_len is None or not isinstance(key_len, int):
        return
    if isinstance(key_len, bool) or not 1 <= key_len <= ctx_len:
        raise ValueError(f"key_len={key_len!r}: expected an int in [1, ctx_len={ctx_len}]")
    if isinstance(position_ids, jax.core.Tracer):
        return
    top = int(np.max(np.asarray(position_ids)))
    if top >= key_len:
        raise ValueError(
            f"key_len={key_len} with position {top}: the step would attend to fewer keys than "
            f"it writes; expected key_len > every position (the least compute context length "
            f"above the step)"
        )


def check_step_values(config, cache, input_ids, position_ids, vision_embeds, image_idx):
    """Host checks of a step's concrete inputs (traced ones pass): token ids in [0, vocab)
    at valid columns, positions in [−1, ctx_len), finite soft tokens, image_idx in [0, V]."""
    valid = None if isinstance(position_ids, jax.core.Tracer) else np.asarray(position_ids) >= 0
    validate.token_ids("input_ids", input_ids, config.vocab_size, valid=valid)
    validate.positions("position_ids", position_ids, cache_len(cache))
    validate.finite("vision_embeds", vision_embeds)
    traced = isinstance(image_idx, jax.core.Tracer) or isinstance(vision_embeds, jax.core.Tracer)
    idx = None if traced or vision_embeds is None else image_idx
    if idx is not None:
        size = np.shape(vision_embeds)[1]
        bad = (np.asarray(idx) < 0) | (np.asarray(idx) > size)
        if bad.any():
            row = int(np.argmax(bad.reshape(-1)))
            raise ValueError(
                f"image_idx[{row}] = {int(np.asarray(idx).reshape(-1)[row])}: expected the "
                f"next unread soft token, in [0, vision_size={size}]"
            )


_SIGNATURE = inspect.signature(apply_step)


def step(*args, **kwargs):
    """`apply_step` compiled (config, attention, last_only, return_hidden, moe static), after
    `check_step_values` and `check_batch_index` on the concrete inputs; same arguments and
    result."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    a = bound.arguments
    config, cache, ids = a["config"], a["cache"], a["input_ids"]
    check_batch_index(cache_view(config, cache), ids, a.get("batch_index"))
    check_step_values(config, cache, ids, a["position_ids"], a.get("vision_embeds"),
                      a.get("image_idx"))  # fmt: skip
    check_key_len(a.get("key_len"), a["position_ids"], cache_len(cache))
    return _compiled_step(*bound.args, **bound.kwargs)


def check_batch_index(cache, input_ids, batch_index):
    """batch_index [B, 1] int with distinct slots in [0, F) (or −1) for a cache of F slots."""
    if batch_index is None or isinstance(batch_index, jax.core.Tracer):
        return
    idx = np.asarray(batch_index)
    slots = next(iter(cache["k"].values())).shape[0]
    b = np.shape(input_ids)[0]
    if idx.shape != (b, 1) or idx.dtype.kind not in "iu":
        raise ValueError(f"batch_index {idx.shape} {idx.dtype}: expected [batch={b}, 1] ints")
    valid = idx[:, 0][idx[:, 0] >= 0]
    bad = (idx[:, 0] < -1) | (idx[:, 0] >= slots)
    if bad.any() or len(set(valid.tolist())) != len(valid):
        raise ValueError(
            f"batch_index {idx[:, 0].tolist()}: expected distinct cache slots in [0, {slots}) "
            "(or −1 for a free row)"
        )
