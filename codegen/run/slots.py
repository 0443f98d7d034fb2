"""Continuous batching (an export with --full-batch-size): the requests, the `batch_index`
column that points a step's rows at cache slots, and `serve`, the loop that moves requests
through the slots — each joins a free slot at its arrival step (prefilled in groups of
batch_size), every occupied slot decodes together, each leaves at a stop id or its
max_new_tokens and frees its slot for a waiting request at the next step."""

import dataclasses

import numpy as np

from codegen.run.errors import RunError
from codegen.run.speculation import Slots
from ref.gemma4 import decoding


@dataclasses.dataclass(frozen=True)
class Request:
    """One request to serve: prompt ids (image and audio runs expanded), its images (patches,
    (h, w)) in order, how many tokens to generate at most, the step at which it arrives, its
    sampling (None: greedy; else a `ref.gemma4.decoding.Sampling`), the row whose generator its
    draws use (0: as a run of it alone; `generate` gives row i its own) and its audio clips
    ([n] float32 at 16 kHz each, in the order of its audio runs)."""

    ids: np.ndarray
    images: list
    max_new_tokens: int
    arrival: int = 0
    sampling: decoding.Sampling | None = None
    row: int = 0
    audios: list = ()


def slot_column(slots, rows):
    """[rows, 1] int32 batch_index: the given slots, −1 for the rows past them."""
    column = np.full((rows, 1), -1, np.int32)
    column[: len(slots), 0] = slots
    return column


def serve(runner, requests, *, log=None, stop=None, emit=None):
    """Continuous batching of `requests` over `runner`'s slots (see `Runner.serve`), through its
    steps: `check`, `start`, `prefill` (rows into the given slots → [rows, V] logits),
    `decode` (every slot, position −1 where free → [slots, V] logits) and `ccl_note`.
    → (tokens per request, timeline: one line per step)."""
    log = log or (lambda msg: None)
    emit = emit or (lambda request, token: None)
    stop = set(runner.stop if stop is None else stop)
    if runner.slots is None:
        raise RunError(f"{runner.folder}: serving needs an export with --full-batch-size")
    for i, r in enumerate(requests):
        runner.check([r.ids], r.max_new_tokens, what=f"request {i}")
    runner.start()
    # speculation (an export with an assistant) when every request is greedy
    greedy = all(r.sampling is None for r in requests)
    # (its round takes the argmax: no suppressed ids)
    speculate = runner.drafts and greedy and not runner.suppress
    spec = Slots(runner.slots, runner.drafts, runner.pad) if speculate else None
    waiting, slot_of, tokens, timeline = list(range(len(requests))), {}, {}, []
    position, last = {}, np.zeros(runner.slots, np.int32)
    t = 0
    while waiting or slot_of:
        events = []
        ready = [r for r in waiting if requests[r].arrival <= t]
        free = [s for s in range(runner.slots) if s not in slot_of.values()]
        joining = ready[: len(free)]
        for k in range(0, len(joining), runner.batch):
            group = joining[k : k + runner.batch]
            slots = free[k : k + len(group)]
            rows = [requests[r].ids for r in group]
            images = [img for r in group for img in requests[r].images]
            audios = [clip for r in group for clip in requests[r].audios]
            logits = runner.prefill(rows, images, slots, log, audios)
            for r, s, row_logits in zip(group, slots, logits, strict=True):
                waiting.remove(r)
                token = decoding.draw(row_logits, requests[r].sampling, requests[r].row, 0,
                                      runner.suppress)  # fmt: skip
                slot_of[r], last[s], tokens[r] = s, token, [token]
                if spec is not None:
                    spec.join(s)
                position[r] = len(requests[r].ids)
                emit(r, token)
                events.append(f"request {r} joins slot {s}")
        decoding_now = [r for r in slot_of if not _finished(requests[r], tokens[r], stop)]
        if decoding_now and spec is not None:
            _round(runner, spec, requests, decoding_now, slot_of, position, last, tokens, stop,
                   emit, events)  # fmt: skip
        elif decoding_now:
            pos = np.full(runner.slots, -1, np.int32)
            for r in decoding_now:
                pos[slot_of[r]] = position[r]
                position[r] += 1
            logits = runner.decode(last, pos, np.arange(runner.slots))
            for r in decoding_now:
                s = slot_of[r]
                n, row = len(tokens[r]), requests[r].row
                last[s] = decoding.draw(logits[s], requests[r].sampling, row, n, runner.suppress)
                tokens[r].append(int(last[s]))
                emit(r, int(last[s]))
            slots_now = sorted(slot_of[r] for r in decoding_now)
            events.append(f"decode slots {slots_now}{runner.ccl_note('decode')}")
        for r in [r for r in slot_of if _finished(requests[r], tokens[r], stop)]:
            why = f"stop id {tokens[r][-1]}" if tokens[r][-1] in stop else "max_new_tokens"
            s = slot_of.pop(r)
            note = "" if spec is None else f" ({spec.report(s, len(tokens[r]))})"
            events.append(f"request {r} leaves slot {s} at {why}{note}")
        timeline.append(f"step {t}: " + "; ".join(events or ["idle"]))
        log(timeline[-1])
        t += 1
    return [np.array(tokens[r]) for r in range(len(requests))], timeline


def _round(runner, spec, requests, live, slot_of, position, last, tokens, stop, emit, events):
    """One speculate call over every slot, the `live` requests' rounds in it: each request's
    emitted tokens appended up to its first stop id or its max_new_tokens (the rest of a round
    after them dropped), its last token and position moved on."""
    pos = np.full(runner.slots, -1, np.int32)
    for r in live:
        pos[slot_of[r]] = position[r]
    emitted = spec.round(runner, last, pos)
    for r in live:
        s = slot_of[r]
        for token in emitted[s]:
            if _finished(requests[r], tokens[r], stop):
                break
            tokens[r].append(token)
            emit(r, token)
        last[s] = emitted[s][-1]
        position[r] += len(emitted[s])
    counts = {slot_of[r]: len(emitted[slot_of[r]]) for r in live}
    events.append(f"speculate slots {dict(sorted(counts.items()))} (tokens each)"
                  f"{runner.ccl_note('speculate')}")  # fmt: skip


def _finished(request, tokens, stop):
    """Whether a request is done: its max_new_tokens emitted, or its last token a stop id."""
    return len(tokens) == request.max_new_tokens or tokens[-1] in stop
