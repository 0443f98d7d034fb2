"""Speculative decoding over an export with an MTP assistant (`export --assistant`): after the
prompt, one `speculate` call per round (`codegen.graphs.speculate`: verify the K drafts, accept,
draft the next K, in one call), the tokens exactly the target's greedy ones. The first round
verifies pad-id drafts (the prompt's call made none), as `ref.gemma4.speculative.device_generate`
does; every later round verifies the drafts the round before made.

`generate` is a batch of prompts; `Slots` is continuous batching's per-slot state for `serve`
(each slot's round in one batched call over every slot).
"""

import numpy as np

from ref.gemma4 import speculative


def round_feed(token, position, drafts, rows, ctx_len):
    """One round's input_ids and position_ids [rows, K + 1] for n = len(token) rows (the rest
    padding): the last token [n] then the drafts [n, K] at P … P + K (position [n], −1 for a
    row without a request; positions at or past ctx_len −1 too)."""
    n, k = drafts.shape
    ids = np.zeros((rows, k + 1), np.int32)
    pos = np.full((rows, k + 1), -1, np.int32)
    ids[:n, 0], ids[:n, 1:] = token, drafts
    pos[:n] = np.where(np.asarray(position)[:, None] >= 0,
                       np.asarray(position)[:, None] + np.arange(k + 1), -1)  # fmt: skip
    pos[pos >= ctx_len] = -1
    return ids, pos


def generate(runner, rows, images, audios, *, max_new_tokens, log, stop, emit):
    """Greedy tokens [len(rows), N] of a batch of prompts with their images and audio clips (as
    `Runner.generate`), each round one `speculate` call; each row's speculation logged in a
    line (`speculative.report`)."""
    stop = runner.stop if stop is None else stop
    runner.start()
    logits = runner.prefill(rows, list(images), None, log, audios)
    rounds = []
    state = speculative.Rows(logits, [len(r) for r in rows], stop, max_new_tokens, runner.pad,
                             runner.drafts, rounds)  # fmt: skip
    for r, row in enumerate(state.rows):
        emit(r, row[0])
    drafts = np.full((len(rows), runner.drafts), runner.pad, np.int32)
    while not state.done.all():
        before = [len(r) for r in state.rows]
        position = state.positions()[:, 0]
        out = runner.speculate(state.token, position, drafts, None)
        state.add_round(out["tokens"], out["accepted"])
        n, drafts = out["accepted"], out["drafts"]
        for r, new in state.emitted_since(before).items():
            for token in new:
                emit(r, token)
        log(f"round {len(rounds)}: accepted {n[~np.isin(position, -1)].tolist()} of "
            f"{runner.drafts}{runner.ccl_note('speculate')}")  # fmt: skip
    for r, row in enumerate(state.rows):
        log(f"row {r} speculation: {speculative.report(rounds, r, len(row))}")
    return state.output()


class Slots:
    """Continuous batching's speculation state per slot: the drafts its next round verifies
    (pad ids after a join: the prompt's call made none) and its rounds (`Round`s as
    `speculative.report` reads them, one row per slot)."""

    def __init__(self, slots, drafts, pad):
        self.pad, self.k = pad, drafts
        self.drafts = np.full((slots, drafts), pad, np.int32)
        self.rounds = {}  # slot → [(proposed, accepted)] of its current request

    def join(self, slot):
        """A request takes `slot`: no drafts yet, no rounds."""
        self.drafts[slot] = self.pad
        self.rounds[slot] = []

    def round(self, runner, last, positions):
        """One round over every slot (positions [slots]: P, −1 for a free or finished slot)
        → {slot: its emitted tokens} of the slots with a position."""
        out = runner.speculate(last, positions, self.drafts, np.arange(len(last)))
        self.drafts = np.array(out["drafts"], np.int32)
        emitted = {}
        for s in np.flatnonzero(positions >= 0):
            n = int(out["accepted"][s])
            emitted[int(s)] = [int(t) for t in out["tokens"][s, : n + 1]]
            self.rounds[int(s)].append((self.k, n))
        return emitted

    def report(self, slot, emitted):
        """The slot's request's speculation in a line (`speculative.report`)."""
        rounds = [speculative.Round((p,), (a,)) for p, a in self.rounds.get(slot, [])]
        return speculative.report(rounds, 0, emitted)
