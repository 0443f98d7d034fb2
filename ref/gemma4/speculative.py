"""Speculative decoding with Gemma 4's MTP assistant (`ref.gemma4.assistant`): greedy, so the
tokens are exactly the target's own greedy tokens, in fewer target steps.

A round, from the last token t at position P and h, the target's final-norm hidden state at the
position that chose t:
1. K drafts, each at position P: d_1 from (the target's scaled embedding of t, h), d_j from
   (that of d_{j−1}, the drafter's projected state of step j − 1); each the drafter's argmax.
   The drafter reads the keys and values the target's cache holds for the shared layers
   (`assistant.shared_layers`) at positions before P, where they live: nothing is copied.
2. One target step over [t, d_1, …, d_K] at positions P … P + K: its logits at each, and
   g_i, its greedy choice after d_i (g_0 after t).
3. n = the number of leading drafts the target agrees with (d_{i+1} = g_i, `accepted`); the
   round emits d_1 … d_n and g_n, the token after them (`emitted`), which is what the target
   alone would have chosen one step at a time. Next round: t = g_n at P + n + 1, h = the
   target's hidden state at P + n.

The rejected drafts' keys stay in the cache at positions P + n + 1 … P + K. With slot =
position the next round writes over each before any query reads it (its queries start at
P + n + 1 and write their own keys first); a sliding layer's ring holds W + K + 1 slots
(`kv_cache.ring_slots`) so that they never evict a key a later query or draft reads.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np

from ref.gemma4.assistant import (
    DEFAULT_DRAFTS,
    draft_keys,
    draft_step,
    shared_layers,
    target_embedding,
)
from ref.gemma4.kv_cache import ring_len, ring_positions, unfolded, uses_ring
from ref.gemma4.text_config import SLIDING


@dataclasses.dataclass(frozen=True)
class Round:
    """One round's drafts per row: proposed (K, or 0 for a row that had stopped) and accepted
    (the leading drafts the target agreed with)."""

    proposed: tuple
    accepted: tuple


def accepted(drafts, chosen):
    """The leading drafts the target agrees with: drafts [B, K], chosen [B, K + 1] (the
    target's greedy choice after the last token and after each draft) → [B] int."""
    drafts, chosen = np.asarray(drafts), np.asarray(chosen)
    agree = drafts == chosen[:, : drafts.shape[1]]
    return np.cumprod(agree, axis=1).sum(axis=1).astype(np.int64)


def emitted(drafts, chosen, n):
    """Each row's tokens of a round: its n accepted drafts, then the target's choice after
    them → list of [n_b + 1] int arrays."""
    drafts, chosen = np.asarray(drafts), np.asarray(chosen)
    return [np.append(d[:k], c[k]) for d, c, k in zip(drafts, chosen, n, strict=True)]


def drafter_keys(config, cache, position):
    """The keys a draft at `position` [B] reads, where the target's cache holds them:
    {layer type: (k, v [B, Hkv, T, hd], kv_pos [B, T])} of each shared layer
    (`assistant.shared_layers`), positions from the cache's records (or, for a slots-only
    cache, slot = position and a ring's `ring_positions`), those at or after `position`
    marked empty (`assistant.draft_keys`)."""
    position = jnp.asarray(position, jnp.int32)[:, None]
    out = {}
    for kind, layer in shared_layers(config).items():
        kv, _ = unfolded((cache["k"][str(layer)], cache["v"][str(layer)]), config.kv_heads[layer])
        b, t = kv[0].shape[0], kv[0].shape[2]
        if kind == SLIDING and uses_ring(config, cache):
            pos = cache.get("ring_pos")
            pos = ring_positions(position, ring_len(config, cache)) if pos is None else pos
        else:
            pos = cache.get("pos", jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
        out[kind] = draft_keys(*kv, pos, position)
    return out


def draft(target, assistant, cache, token, hidden, position, count):
    """`count` drafts per row from the last token [B] at `position` [B] with the target's
    hidden state [B, D] that chose it → (drafts [B, count] int32, the drafter's logits
    [B, count, V]). target: a `Gemma4`; assistant: an `assistant.AssistantModel`."""
    keys = drafter_keys(target.config, cache, position)
    at = jnp.asarray(position, jnp.int32)[:, None]
    h = jnp.asarray(hidden)[:, None]
    token = np.asarray(token)
    drafts, logits = [], []
    for _ in range(count):
        ids = jnp.asarray(token)[:, None]
        embeds = target_embedding(target.params, ids, target.config.hidden_size)
        out = draft_step(assistant.params, assistant.config, embeds, h, at, keys)
        token = np.asarray(jnp.argmax(out["logits"][:, 0], axis=-1), np.int32)
        h = out["projected"]
        drafts.append(token)
        logits.append(out["logits"][:, 0])
    return np.stack(drafts, axis=1), jnp.stack(logits, axis=1)


def drafts_for(assistant, count, sampling, target):
    """The drafts a round proposes: 0 without an assistant; else `count`, or the assistant's
    generation_config `num_assistant_tokens`, or `DEFAULT_DRAFTS`; ValueError for what cannot
    speculate here (sampling, a step function of the caller's, an assistant made for another
    target)."""
    if assistant is None:
        if count is not None:
            raise ValueError(f"num_speculative_tokens={count!r} given without an assistant")
        return 0
    count = count if count is not None else assistant.config.num_assistant_tokens
    count = DEFAULT_DRAFTS if count is None else count
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"num_speculative_tokens={count!r}: expected an int >= 1")
    if sampling is not None:
        raise ValueError("speculative decoding is greedy here: sampling given with an assistant")
    if target.step_fn is not None:
        raise ValueError("speculative decoding runs the model's own step: with_step was used")
    check_pair(target.config, assistant.config)
    return count


def check_pair(target, config):
    """ValueError unless a drafter (`AssistantConfig`) fits the target (`TextConfig`): its
    backbone is the target's hidden size, one vocabulary, and each layer type's heads and
    head size are those of the target layer it reads (`shared_layers`)."""
    text = config.text
    if config.backbone_hidden_size != target.hidden_size or text.vocab_size != target.vocab_size:
        raise ValueError(
            f"assistant backbone_hidden_size={config.backbone_hidden_size}, vocab_size="
            f"{text.vocab_size}: expected the target's {target.hidden_size}, {target.vocab_size}"
        )
    source = shared_layers(target)
    for i, kind in enumerate(text.layer_types):
        j = source.get(kind)
        if j is None or (text.head_dims[i], text.kv_heads[i]) != (
            target.head_dims[j],
            target.kv_heads[j],
        ):
            want = None if j is None else (target.head_dims[j], target.kv_heads[j])
            raise ValueError(
                f"assistant layer {i} ({kind}): head_dim, kv heads "
                f"{(text.head_dims[i], text.kv_heads[i])}; the target's layer {j} has {want}"
            )


def generate(target, assistant, run, first, lengths, max_new_tokens, drafts, stop, pad,
             rounds=None):  # fmt: skip
    """Greedy speculative generation after a prefill → [B, N] int32 ids, each row ended at its
    first stop id (kept) and padded after it with `pad` (N the longest row, ≤ max_new_tokens).

    target: a `Gemma4`; assistant: an `assistant.AssistantModel`; run(cache, ids [B, S], positions
    [B, S]) → the target's step dict (logits and hidden at every position, cache); first:
    (cache, logits [B, V], hidden [B, D]) after each row's prompt; lengths: [B] prompt
    lengths; drafts: K ≥ 1; stop: the stop ids; rounds: a list each round's `Round` is
    appended to, or None."""
    cache, logits, hidden = first
    b = len(lengths)
    token = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1), np.int32)
    rows = [[int(t)] for t in token]
    stop = set(int(s) for s in stop)
    done = np.array([_ended(r, stop, max_new_tokens) for r in rows])
    position = np.asarray(lengths, np.int32)
    while not done.all():
        proposed, _ = draft(target, assistant, cache, token, hidden, position, drafts)
        ids = np.concatenate([token[:, None], proposed], axis=1)
        positions = position[:, None] + np.arange(drafts + 1, dtype=np.int32)
        positions[done] = -1  # a row that has stopped computes and writes nothing
        out = run(cache, ids, positions)
        cache = out["cache"]
        chosen = np.asarray(jnp.argmax(out["logits"], axis=-1), np.int32)
        n = accepted(proposed, chosen)
        live = ~done
        for r, new in enumerate(emitted(proposed, chosen, n)):
            if live[r]:
                rows[r] = _cut(rows[r] + [int(x) for x in new], stop, max_new_tokens)
        if rounds is not None:
            rounds.append(Round(tuple(int(x) for x in np.where(live, drafts, 0)),
                                tuple(int(x) for x in np.where(live, n, 0))))  # fmt: skip
        done = done | np.array([_ended(r, stop, max_new_tokens) for r in rows])
        token = chosen[np.arange(b), n]
        hidden = out["hidden"][np.arange(b), n]
        position = np.where(done, position, position + n.astype(np.int32) + 1)
    width = max(len(r) for r in rows)
    return np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)


def _cut(row, stop, most):
    """row up to its first stop id (kept) and at most `most` tokens."""
    for i, t in enumerate(row):
        if t in stop:
            return row[: min(i + 1, most)]
    return row[:most]


def _ended(row, stop, most):
    return len(row) >= most or (len(row) > 0 and row[-1] in stop)
