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
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ref.attention import reference
from ref.cache import take_rows
from ref.gemma4.assistant import (
    DEFAULT_DRAFTS,
    Assistant,
    draft_keys,
    shared_layers,
    target_embedding,
)
from ref.gemma4.kv_cache import first_slots, ring_len, ring_positions, unfolded, uses_ring
from ref.gemma4.step import apply_step
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


def drafter_keys(config, cache, position, rows=None, key_len=None):
    """The keys a draft at `position` [B] reads, where the target's cache holds them:
    {layer type: (k, v [F, Hkv, T, hd], kv_pos [B, T], rows)} of each shared layer
    (`assistant.shared_layers`), positions from the cache's records (or, for a slots-only
    cache, slot = position and a ring's `ring_positions`), those at or after `position`
    marked empty (`assistant.draft_keys`). rows: None (F = B), or [B] int (continuous
    batching: row b reads cache slot rows[b], as the attention reads it, never a gathered
    copy); key_len: None, or a compute context length above `position` (an int or an
    exporter's symbol): a layer read by position keeps its first key_len slots."""
    position = jnp.asarray(position, jnp.int32)[:, None]
    out = {}
    for kind, layer in shared_layers(config).items():
        kv, _ = unfolded((cache["k"][str(layer)], cache["v"][str(layer)]), config.kv_heads[layer])
        b, t = position.shape[0], kv[0].shape[2]
        if kind == SLIDING and uses_ring(config, cache):
            pos = cache.get("ring_pos")
            pos = ring_positions(position, ring_len(config, cache)) if pos is None else pos
        else:
            pos = cache.get("pos", jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))
            kv = tuple(first_slots(x, key_len, 2) for x in kv)
            pos = first_slots(pos, key_len, 1)
        if rows is not None and ("pos" in cache or "ring_pos" in cache):
            pos = take_rows(pos, rows)  # records are the cache's F rows; the draft's are B
        out[kind] = (*draft_keys(*kv, pos, position), rows)
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
        out = assistant.apply(embeds, h, at, keys)
        token = np.asarray(jnp.argmax(out["logits"][:, 0], axis=-1), np.int32)
        h = out["projected"]
        drafts.append(token)
        logits.append(out["logits"][:, 0])
    return np.stack(drafts, axis=1), jnp.stack(logits, axis=1)


def device_round(params, lm_head, drafter, cache, ids, positions, batch_index=None, *, config,
                 assistant, attention=reference, moe=None, key_len=None):  # fmt: skip
    """One round as one device call, QAIC's way: the target's step over [t, d_1 … d_K], the
    acceptance (greedy) and the next round's K drafts all in the call; the host reads the
    tokens only, and no cache leaves the device (a pure function: jit it, or trace it).

    params, lm_head: the target's (`apply_step`'s); drafter: the assistant's checkpoint tree;
    cache: the target's; ids [B, K + 1]: the last token and the drafts to verify (any ids: a
    first round after the prompt has none yet, and its acceptance is then whatever the
    target agrees with); positions [B, K + 1]: P … P + K (−1: a row without a request, whose
    results mean nothing); batch_index, key_len, moe: `apply_step`'s (continuous batching's
    slots, a compute context length above P + K, how the experts run; the drafter reads the
    same slots and lengths); config: the target's TextConfig; assistant: an `AssistantConfig`
    → {"tokens": [B, K + 1] the round's emitted tokens (row
    b's first accepted[b] + 1; −1 after them), "accepted": [B] int32, "drafts": [B, K] for
    the next round, from the last emitted token at P + accepted + 1, "cache"}."""
    drafts = ids.shape[1] - 1
    out = apply_step(params, lm_head, cache, ids, positions, None, None, batch_index,
                     config=config, attention=attention, moe=moe, key_len=key_len)  # fmt: skip
    chosen = jnp.argmax(out["logits"], axis=-1).astype(jnp.int32)  # [B, K + 1]
    agree = (ids[:, 1:] == chosen[:, :-1]).astype(jnp.int32)
    # the first disagreement's index: ArgMax takes the first of equal maxima (ONNX's default,
    # an op QEfficient's exports use); no CumProd
    n = jnp.argmax(jnp.concatenate([1 - agree, jnp.ones_like(agree[:, :1])], axis=1), axis=1)
    n = n.astype(jnp.int32)  # positions stay int32 with jax_enable_x64 too (as the graph's)
    at = n[:, None]
    token = jnp.take_along_axis(chosen, at, axis=1)  # [B, 1]
    h = jnp.take_along_axis(out["hidden"], at[:, :, None], axis=1)  # [B, 1, D]
    slot = lax.broadcasted_iota(jnp.int32, chosen.shape, 1)
    shifted = jnp.concatenate([ids[:, 1:], token], axis=1).astype(jnp.int32)
    tokens = jnp.where(slot < at, shifted, jnp.where(slot == at, token, -1))
    position = positions[:, 0].astype(jnp.int32) + n + 1
    rows = None if batch_index is None else batch_index[:, 0]
    keys = drafter_keys(config, out["cache"], position, rows, key_len)
    next_drafts = []
    for _ in range(drafts):
        embeds = target_embedding(params, token, config.hidden_size)
        step_out = Assistant(assistant).apply({"params": drafter}, embeds, h, position[:, None],
                                              keys)  # fmt: skip
        token = jnp.argmax(step_out["logits"], axis=-1).astype(jnp.int32)  # [B, 1]
        h = step_out["projected"]
        next_drafts.append(token)
    return {"tokens": tokens, "accepted": n,
            "drafts": jnp.concatenate(next_drafts, axis=1), "cache": out["cache"]}  # fmt: skip


def drafts_for(assistant, count, sampling, target):
    """The drafts a round proposes: 0 without an assistant; else `count`, or the assistant's
    generation_config `num_assistant_tokens`, or `DEFAULT_DRAFTS`; ValueError for what cannot
    speculate here (sampling, suppressed ids, a step function of the caller's, an assistant made
    for another target)."""
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
    if target.suppress:
        raise ValueError(
            f"suppressed ids {target.suppress}: a round accepts the target's argmax, which does "
            "not suppress them; generate without assistant"
        )
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


class Rows:
    """Each row's emitted tokens and where its next round starts: a row ends at its first
    stop id (kept) or at `most` tokens; a round's rows that had ended take part as padding
    (position −1: they compute and write nothing)."""

    def __init__(self, logits, lengths, stop, most, pad, drafts, rounds):
        token = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1), np.int32)
        self.rows = [[int(t)] for t in token]
        self.stop, self.most, self.pad, self.drafts = set(int(x) for x in stop), most, pad, drafts
        self.rounds = rounds
        self.token, self.position = token, np.asarray(lengths, np.int32)
        self.done = np.array([self._ended(r) for r in self.rows])

    def positions(self):
        """[B, K + 1]: P … P + K of each live row, −1 for an ended one."""
        out = self.position[:, None] + np.arange(self.drafts + 1, dtype=np.int32)
        out[self.done] = -1
        return out

    def emitted_since(self, lengths):
        """{row: its tokens after the first `lengths[row]`} of the rows that grew."""
        return {r: row[n:] for r, (row, n) in enumerate(zip(self.rows, lengths, strict=True))
                if len(row) > n}  # fmt: skip

    def add(self, new, n, chosen):
        """A round's emitted tokens per row (`new`), accepted counts n [B] and the token after
        them per row (`chosen`, the next round's last token)."""
        live = ~self.done
        for r, tokens in enumerate(new):
            if live[r]:
                self.rows[r] = self._cut(self.rows[r] + [int(x) for x in tokens])
        if self.rounds is not None:
            self.rounds.append(Round(tuple(int(x) for x in np.where(live, self.drafts, 0)),
                                     tuple(int(x) for x in np.where(live, n, 0))))  # fmt: skip
        self.done = self.done | np.array([self._ended(r) for r in self.rows])
        self.token = np.asarray(chosen, np.int32)
        self.position = np.where(live, self.position + n.astype(np.int32) + 1, self.position)

    def add_round(self, tokens, n):
        """`add` of a device round's results: tokens [B, K + 1] (row b's first n[b] + 1 its
        emitted ones), n [B] accepted counts."""
        tokens, n = np.asarray(tokens), np.asarray(n)
        last = tokens[np.arange(len(n)), n]
        self.add([t[: k + 1] for t, k in zip(tokens, n, strict=True)], n, last)

    def output(self):
        """[B, N] int32, each row padded with the pad id to the longest."""
        width = max(len(r) for r in self.rows)
        return np.array([r + [self.pad] * (width - len(r)) for r in self.rows], np.int32)

    def _cut(self, row):
        for i, t in enumerate(row):
            if t in self.stop:
                return row[: min(i + 1, self.most)]
        return row[: self.most]

    def _ended(self, row):
        return len(row) >= self.most or (len(row) > 0 and row[-1] in self.stop)


def report(rounds, row, emitted):
    """One row's speculation in a line: its rounds, accepted drafts per round (of K), tokens per
    round and target calls per token (the prompt's last call made the first token; plain
    decoding makes 1.00). rounds: the `Round`s of its generation; emitted: its token count."""
    mine = [(r.proposed[row], r.accepted[row]) for r in rounds if r.proposed[row]]
    if not mine:
        return f"0 rounds, {emitted} token(s) from the prompt's call"
    k = mine[0][0]
    accepted = sum(a for _, a in mine) / len(mine)
    return (f"{len(mine)} rounds, {accepted:.2f} of {k} drafts accepted per round, "
            f"{(emitted - 1) / len(mine):.2f} tokens per round, "
            f"{(len(mine) + 1) / emitted:.2f} target calls per token")  # fmt: skip


def generate(target, assistant, run, first, lengths, max_new_tokens, drafts, stop, pad,
             rounds=None):  # fmt: skip
    """Greedy speculative generation after a prefill → [B, N] int32 ids, each row ended at its
    first stop id (kept) and padded after it with `pad` (N the longest row, ≤ max_new_tokens).

    target: a `Gemma4`; assistant: an `assistant.AssistantModel`; run(cache, ids [B, S],
    positions [B, S]) → the target's step dict (logits and hidden at every position, cache);
    first: (cache, logits [B, V], hidden [B, D]) after each row's prompt; lengths: [B] prompt
    lengths; drafts: K ≥ 1; stop: the stop ids; rounds: a list each round's `Round` is
    appended to, or None."""
    cache, logits, hidden = first
    rows = Rows(logits, lengths, stop, max_new_tokens, pad, drafts, rounds)
    every = np.arange(len(lengths))
    while not rows.done.all():
        proposed, _ = draft(target, assistant, cache, rows.token, hidden, rows.position, drafts)
        out = run(cache, np.concatenate([rows.token[:, None], proposed], axis=1), rows.positions())
        cache = out["cache"]
        chosen = np.asarray(jnp.argmax(out["logits"], axis=-1), np.int32)
        n = accepted(proposed, chosen)
        hidden = out["hidden"][every, n]
        rows.add(emitted(proposed, chosen, n), n, chosen[every, n])
    return rows.output()


def device_generate(target, assistant, first, lengths, max_new_tokens, drafts, stop, pad,
                    rounds=None):  # fmt: skip
    """`generate` with each round one `device_round` call (compiled once): the same tokens;
    the first round verifies pad-id drafts (the prompt's call made none), so its acceptance
    is whatever the target agrees with, and every later round's drafts come out of the round
    before. first: (cache, logits [B, V]) after each row's prompt; the rest as `generate`'s."""
    cache, logits = first
    rows = Rows(logits, lengths, stop, max_new_tokens, pad, drafts, rounds)
    proposed = np.full((len(lengths), drafts), pad, np.int32)
    one = jax.jit(partial(device_round, config=target.config, assistant=assistant.config))
    while not rows.done.all():
        ids = np.concatenate([rows.token[:, None], proposed], axis=1)
        out = one(target.params, target.lm_head, assistant.params, cache, ids, rows.positions())
        cache = out["cache"]
        rows.add_round(out["tokens"], out["accepted"])
        proposed = np.asarray(out["drafts"])
    return rows.output()
