"""`run OUT`: greedy generation over an export folder's graphs in onnxruntime, driven the way
the QAIC runtime drives the compiled programs (QEfficient's `kv_offload_generate`):

1. `vision` on each prompt row's images and video frames, packed into as few calls as the
   largest exported budget allows;
2. `prefill` chunk by chunk at the compiled `seq_len` (the last chunk padded with position −1),
   each chunk given the soft tokens of its own image runs as `vision_embeds` at the least
   budget that holds them (`image_idx` 0);
3. `decode` one token at a time.

Each graph is a compiled program held to the device's rules (`codegen.run.device.Program`):
it runs only at its specializations' shapes, and its KV cache is retained state it keeps.
Where the cache's next reader is another program (a `prefill` and a `decode` graph compile to
two), the cache is handed over whole through the host (`_hand_to`), and every byte is counted
(`transfers`).

A graph exported with compute context lengths (`--comp-ctx-lengths-prefill/-decode`) is fed,
at each prefill chunk and decode step, `comp_ctx_lengths` of the least length above every
position of that step (`ccl_for`): over the rows that hold a request only, so a finished
slot's old positions never keep a batch on a longer one (QEfficient's runner takes them).

Nothing but the folder is needed: manifest.json, the graphs, config.json and the hard-linked
shards. Chunks never split an image run (its first tokens attend to its last ones), so a run
longer than the compiled `seq_len` is refused, naming the `seq_len` it needs.

`Runner` opens the graphs and makes their calls: prefill chunks, decode steps, each step's
compute context length; the vision graph's calls are `codegen.run.vision`'s, continuous
batching's slot bookkeeping `codegen.run.slots`'.
"""

import functools

import numpy as np

from codegen.folder.opened import open_folder
from codegen.folder.sessions import open_session
from codegen.run import audio, speculation, unified
from codegen.run.device import Transfers
from codegen.run.errors import RunError
from codegen.run.programs import ccl_for, decode_media, kv_dtype, lengths, program
from codegen.run.slots import Request, serve, slot_column
from codegen.run.vision import Vision
from ref.gemma4 import decoding
from ref.gemma4.schedule import chunk_arrays, chunk_bounds, image_runs
from ref.gemma4.unified_config import any_text_config
from weights import generation_config


class Runner:
    """The export folder's vision, prefill and decode graphs as onnxruntime sessions, and their
    calls: `generate` (a batch of prompts), `serve` (requests through continuous batching's
    slots, `codegen.run.slots`), and the steps both are made of: `prefill` (chunk by chunk, the
    images through `codegen.run.vision`), `decode` (one token per row), each call fed its
    compute context length (`_run`)."""

    def __init__(self, folder, *, check_shards=True, decode_folder=None, on_call=None,
                 speculate=True, engine=open_session):  # fmt: skip
        """folder: an export with prefill and decode graphs (a path, or an opened
        `codegen.folder.opened.Export`: not opened again), or a `--prefill-only` export
        whose KV cache hands over to the decode graph of `decode_folder` (a `--decode-only`
        export with the same retained-state layout); on_call(kind, feed): told of every
        graph call before it runs (`verify --write-npi --prompts` records the feeds);
        speculate: with an export's speculate graph, greedy generation runs a round per call
        (`codegen.run.speculation`; False: the decode graph, a token per call); engine(entry,
        folder, checkpoint): each program's session (`codegen.run.device.ShapeOnly` counts
        transfers without computing)."""
        self.on_call = on_call or (lambda kind, feed: None)
        self.export = open_folder(folder, check_shards=check_shards)
        self.folder, manifest = self.export.folder, self.export.manifest
        graphs = {unified.ROLES.get(g.kind, g.kind): g for g in manifest.graphs}
        if "language" in graphs:  # one program: prefill and decode are its specializations
            graphs["prefill"] = graphs["decode"] = graphs.pop("language")
        self.checkpoint = self.export.checkpoint
        # kind → (folder, checkpoint, the KV format its program keeps the cache in)
        homes = {kind: (self.folder, self.checkpoint, kv_dtype(manifest)) for kind in graphs}
        if decode_folder is not None:
            decoding_side = open_folder(decode_folder, check_shards=check_shards)
            decode_folder, other = decoding_side.folder, decoding_side.manifest
            entry = next((g for g in other.graphs if g.kind == "decode"), None)
            if entry is None:
                raise RunError(f"{decode_folder} has no decode graph (export it --decode-only)")
            if other.retained_layout != manifest.retained_layout:
                raise RunError(
                    f"{decode_folder}: its KV-cache layout {other.retained_layout} is not "
                    f"the prefill's {manifest.retained_layout}: export both sides with "
                    "the same model, batch, ctx_len and cache options (an --assistant's K "
                    "sizes the sliding ring: give both sides the same)"
                )
            home = (decode_folder, decoding_side.checkpoint, kv_dtype(other))
            graphs["decode"], homes["decode"] = entry, home
            for g in other.graphs:  # the decode side's speculate graph (its --assistant)
                if g.kind == "speculate":
                    graphs["speculate"], homes["speculate"] = g, home
        missing = [k for k in ("prefill", "decode") if k not in graphs]
        if missing:
            raise RunError(
                f"{self.folder} has no {' or '.join(missing)} graph: export with --graphs model"
                + (" (or give the decode side's folder)" if missing == ["decode"] else "")
            )
        self.text = any_text_config(self.checkpoint.config)
        self.entries = graphs
        self.transfers = Transfers()
        self.programs, made = {}, {}
        for kind in ("vision", "audio", "prefill", "decode", "speculate"):
            if kind in graphs and (kind != "speculate" or speculate):
                key = (homes[kind][0], graphs[kind].name)  # one program per graph
                if key not in made:
                    made[key] = program(graphs[kind], homes[kind], self.transfers, engine)
                self.programs[kind] = made[key]
        self.holder = None  # the kind whose program holds the live KV cache (None: none yet)
        # an export with an MTP assistant: K drafts a round (0: decode one token a call)
        self.drafts = graphs["speculate"].options["drafts"] if "speculate" in self.programs else 0
        o = graphs["prefill"].options
        self.batch, self.seq_len, self.ctx_len = o["batch_size"], o["seq_len"], o["ctx_len"]
        self.budgets = sorted(o["budgets"])
        self.slots = o["full_batch_size"]  # continuous batching: the cache's slots
        # per graph kind, its compute context lengths (empty: it takes no comp_ctx_lengths)
        self.ccls = {k: lengths(graphs[k], k) for k in self.programs
                     if k not in ("vision", "audio")}  # fmt: skip
        # what a decode step feeds besides ids and positions (a language program's decode
        # specialization takes a one-row vision_embeds and image_idx, zeros)
        self.decode_media = decode_media(graphs["decode"])
        self.ccl_steps = []  # (kind, the length fed) per call of a graph with lengths
        # the checkpoint's generation_config.json (copied into the export), else config.json
        self.generation_config = generation_config(self.folder)
        # its stop ids, pad id and the ids never chosen (suppress_tokens, begin_suppress_tokens)
        self.stop, self.pad, self.suppress = decoding.generation_ids(
            self.generation_config, self.checkpoint.config
        )

    def generate(
        self, prompts, images=(), *, audios=(), max_new_tokens, log=None, stop=None,
        sampling=None, emit=None,
    ):  # fmt: skip
        """Tokens [len(prompts), N]: each row ends at its first stop id (kept) and is padded
        after it with the pad id; N is max_new_tokens, or fewer once every row has stopped
        (transformers' `generate`).

        prompts: token-id sequences, each image already a run of image tokens (at most the
        compiled batch_size rows, or full_batch_size with continuous batching); images:
        (patches [h·w, 3·p·p] in [0, 1], (h, w)) per image run, in order of appearance, row by
        row; audios: [n] float32 samples at 16 kHz per audio clip, in order of appearance, row
        by row (a clip of ≤ 160 samples has no run); stop: stop ids (None: the export's, ()
        never stops); sampling: None (greedy) or a
        `ref.gemma4.decoding.Sampling` (row r's n-th token drawn with (seed, r, n)); emit:
        called with (row, token) as each token of a running row arrives.
        """
        log = log or (lambda msg: None)
        emit = emit or (lambda row, token: None)
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        self.check(rows, max_new_tokens)
        if self.slots is not None:
            it = iter(images)
            clips = audio.per_row(rows, audios, self.text.audio_token_id,
                                  unified.media(self.checkpoint.config))  # fmt: skip
            requests = [
                Request(
                    r,
                    [next(it) for _ in image_runs(r, *self.text.vision_token_ids)],
                    max_new_tokens,
                    sampling=sampling,
                    row=i,
                    audios=clips[i],
                )
                for i, r in enumerate(rows)
            ]
            tokens = self.serve(requests, log=log, stop=stop, emit=emit)[0]
            width = max(len(t) for t in tokens)
            return np.stack(
                [np.pad(t, (0, width - len(t)), constant_values=self.pad) for t in tokens]
            )
        if self.drafts and sampling is None and not self.suppress:
            return speculation.generate(self, rows, images, audios, log=log, stop=stop,
                                        max_new_tokens=max_new_tokens, emit=emit)  # fmt: skip
        if self.drafts:
            log("the decode graph, a token per call: the speculate graph's round takes the "
                "argmax, neither sampled nor with suppressed ids")  # fmt: skip
        stopper = decoding.Stopper(self.stop if stop is None else stop, self.pad, len(rows))
        self.start()
        logits = self.prefill(rows, list(images), None, log, audios)
        tokens = [self._emit(stopper, decoding.choose(logits, sampling, 0, None, self.suppress),
                             emit)]  # fmt: skip
        position = np.array([len(r) for r in rows], np.int32)
        for n in range(1, max_new_tokens):
            if stopper.done:
                break
            logits = self.decode(tokens[-1], position, None)
            chosen = decoding.choose(logits, sampling, n, None, self.suppress)
            tokens.append(self._emit(stopper, chosen, emit))
            position = position + 1
            log(f"decode step {n + 1}/{max_new_tokens}{self.ccl_note('decode')}")
        return np.stack(tokens, axis=1)

    @staticmethod
    def _emit(stopper, tokens, emit):
        """One step's tokens with finished rows padded; each running row's token emitted."""
        running = stopper.running.copy()
        out = stopper(tokens)
        for row in np.flatnonzero(running):
            emit(int(row), int(out[row]))
        return out

    def serve(self, requests, *, log=None, stop=None, emit=None):
        """Continuous batching over the exported slots (an export with --full-batch-size):
        requests join free slots at their arrival step (prefilled in groups of batch_size),
        every occupied slot decodes together, each leaves once it has emitted a stop id or its
        max_new_tokens, and its slot is free for a waiting request at the next step.
        stop: stop ids (None: the export's, () never stops); emit: called with (request,
        token) as each token arrives.
        → (tokens per request, timeline: one line per step)."""
        return serve(self, requests, log=log, stop=stop, emit=emit)

    def start(self):
        """A new batch of sequences: no cache the next call reads yet (the programs' state as
        it is: a sequence starting at position 0 reads none of a former one's keys, and
        `ring_positions` marks a ring's slots empty), so no handoff before it."""
        self.holder = None

    def prefill(self, rows, images, slots, log, audios=()):
        """Chunked prefill of rows (≤ batch_size token-id arrays [L_i]) into their cache rows,
        or into `slots` (a slot per row) with continuous batching → [rows, V] logits of each
        row's last prompt token. images: (patches, (h, w)) per image run of the rows, in
        order; audios: the clips of the rows' audio runs, in order (`generate`, `serve`),
        through the audio graph
        (`codegen.run.audio`), their soft tokens in the rows' streams.

        Each chunk gets the soft tokens of its own vision runs (`_window`, image_idx 0), so a
        prompt may hold more soft tokens (a video's frames) than any exported vision budget:
        only a chunk's must fit one."""
        runs = [image_runs(r, *self.text.vision_token_ids) for r in rows]
        streams = self._vision().streams(runs, images, log)
        soft_ids = self.text.vision_token_ids
        if self.text.audio_token_id is not None and streams is not None:
            clips = audio.embed_clips(self.checkpoint.config, self.entries.get("audio"),
                                      functools.partial(self._run, "audio"), audios)  # fmt: skip
            streams = audio.merge(rows, streams, soft_ids, (self.text.audio_token_id,), clips,
                                  self.text.hidden_size)  # fmt: skip
            soft_ids = (*soft_ids, self.text.audio_token_id)
        elif len(audios):
            raise RunError(f"{len(audios)} audio clips given but the export takes no audio")
        for i, row_runs in enumerate(runs):
            for start, n in row_runs:
                if n > self.seq_len:
                    raise RunError(
                        f"row {i}: the image run at {start} has {n} tokens but one prefill chunk "
                        f"holds seq_len={self.seq_len}: export with --seq-len {n} or more "
                        "(a chunk must not split an image run)"
                    )
        most = self.budgets[-1] if streams is not None else None
        schedule = [chunk_bounds(len(r), runs[i], self.seq_len, most) for i, r in enumerate(rows)]
        offsets = np.zeros(len(rows), int)
        last = [None] * len(rows)
        chunks = max(len(s) for s in schedule)
        for k in range(chunks):
            ids, pos = chunk_arrays(rows, schedule, k, self.batch, self.seq_len)
            counts = np.isin(ids[: len(rows)], soft_ids) & (pos[: len(rows)] >= 0)
            counts = counts.sum(axis=1)
            if streams is not None and counts.max() > most:
                raise RunError(
                    f"prefill chunk {k + 1} holds {counts.max()} soft tokens (audio runs are cut "
                    f"by chunk, not by budget); the largest vision budget is {most}: export "
                    f"with --seq-len {most} or less, or a larger budget"
                )
            feed = {"input_ids": ids, "position_ids": pos}
            if streams is not None:
                feed.update(self._window(streams, offsets, counts))
                offsets += counts
            if slots is not None:
                feed["batch_index"] = slot_column(slots, self.batch)
            out = self._run("prefill", feed)
            for i, bounds in enumerate(schedule):
                if k == len(bounds) - 1:
                    last[i] = out["logits"][i, 0]
            log(f"prefill chunk {k + 1}/{chunks}{self.ccl_note('prefill')}")
        return np.stack(last)

    def _window(self, streams, offsets, counts):
        """One chunk's vision inputs: each row's next `counts` soft tokens of its stream from
        `offsets`, zero-padded to the least budget that holds the most → {vision_embeds
        [batch, budget, hidden], image_idx [batch, 1] zeros}."""
        budget = next(b for b in self.budgets if b >= counts.max())
        out = np.zeros((self.batch, budget, self.text.hidden_size), np.float32)
        for i, stream in enumerate(streams):
            out[i, : counts[i]] = stream[offsets[i] : offsets[i] + counts[i]]
        return {"vision_embeds": out, "image_idx": np.zeros((self.batch, 1), np.int32)}

    def decode(self, token, position, slots):
        """One decode step: token [n] ids at position [n] (−1: a free row), in rows 0..n−1 of the
        cache, or with `slots` ([n] slot per row) in those slots → [n, V] logits."""
        n = len(token)
        rows = self.batch if self.slots is None else self.slots
        ids = np.zeros((rows, 1), np.int32)
        pos = np.full((rows, 1), -1, np.int32)
        ids[:n, 0], pos[:n, 0] = token, position
        feed = {"input_ids": ids, "position_ids": pos, **self.decode_media}
        if slots is not None:
            feed["batch_index"] = slot_column(slots, rows)
        return self._run("decode", feed)["logits"][:n, 0]

    def speculate(self, token, position, drafts, slots):
        """One round of the speculate graph: token [n] with drafts [n, K] at position [n] (P;
        −1: a free row), in rows 0..n−1 of the cache, or with `slots` in those slots →
        {"tokens" [n, K + 1], "accepted" [n], "drafts" [n, K]}."""
        rows = self.batch if self.slots is None else self.slots
        ids, pos = speculation.round_feed(token, position, drafts, rows, self.ctx_len)
        feed = {"input_ids": ids, "position_ids": pos}
        if slots is not None:
            feed["batch_index"] = slot_column(slots, rows)
        out = self._run("speculate", feed)
        return {k: out[k][: len(token)] for k in ("tokens", "accepted", "drafts")}

    def check(self, rows, max_new_tokens, what="row"):
        """Refuse (RunError) rows (token-id arrays [L]) the graphs cannot take: more than
        batch_size of them (full_batch_size with slots), an empty one, an id outside the
        vocabulary, or prompt and max_new_tokens past ctx_len; `what` names a row ("row": by
        its index)."""
        most = self.batch if self.slots is None else self.slots
        if not 1 <= len(rows) <= most:
            raise RunError(f"{len(rows)} prompts: the graphs take 1 to batch_size={most}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RunError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
        for i, r in enumerate(rows):
            name = what if what != "row" else f"row {i}"
            if len(r) == 0:
                raise RunError(f"{name}: empty prompt")
            bad = np.flatnonzero((r < 0) | (r >= self.text.vocab_size))
            if bad.size:
                raise RunError(
                    f"{name}: token id {int(r[bad[0]])} at {int(bad[0])} is outside "
                    f"[0, vocab_size={self.text.vocab_size})"
                )
            if len(r) + max_new_tokens > self.ctx_len:
                raise RunError(
                    f"{name}: {len(r)} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                    f"ctx_len={self.ctx_len}"
                )

    def _vision(self):
        """The vision graph's calls over the sessions as they are now (`Vision`)."""
        return Vision(
            self.checkpoint.config,
            self.budgets,
            self.text.hidden_size,
            takes_images="vision_embeds" in {t.name for t in self.entries["prefill"].inputs},
            run=functools.partial(self._run, "vision") if "vision" in self.programs else None,
        )

    def ccl_note(self, kind):
        """ ", comp_ctx_lengths K" of the last call of `kind` when it took one, else ""."""
        if not self.ccls.get(kind):
            return ""
        return f", comp_ctx_lengths {next(k for g, k in reversed(self.ccl_steps) if g == kind)}"

    def _run(self, kind, feed):
        """One call of `kind`'s program on `feed` (no retained state: the program keeps it)
        → {output name: array} but the retained state; a graph with compute context lengths
        is also fed `comp_ctx_lengths` [K], K = `ccl_for` its positions (recorded in
        `ccl_steps`). `on_call` is told the whole feed, the program's state included."""
        if self.ccls.get(kind):
            k = ccl_for(self.ccls[kind], feed["position_ids"])
            feed = {**feed, "comp_ctx_lengths": np.zeros(k, np.int64)}
            self.ccl_steps.append((kind, k))
        program = self.programs[kind]
        if program.retained:
            self._hand_to(kind)
        return program.run(kind, feed, observe=lambda whole: self.on_call(kind, whole))

    def _hand_to(self, kind):
        """Make `kind`'s program hold the live KV cache: when another program holds it (a
        prefill and a decode graph are two programs), the whole cache crosses the host, out of
        that program and into this one (the handoff QEfficient's split programs make)."""
        here, there = self.programs[kind], self.programs.get(self.holder)
        if there is not None and there is not here:
            call = f"handoff {self.holder}→{kind}"
            here.write_state(call, there.read_state(call))
        self.holder = kind
