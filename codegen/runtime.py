"""`run OUT`: greedy generation over an export folder's graphs in onnxruntime, driven the way
the QAIC runtime drives the compiled programs (QEfficient's `kv_offload_generate`):

1. `vision` once per prompt row that holds images, at the prefill's vision budget;
2. `prefill` chunk by chunk at the compiled `seq_len` (the last chunk padded with position −1),
   `image_idx_output` fed back as `image_idx`, every `*_RetainedState` fed back as the cache;
3. `decode` one token at a time, every `*_RetainedState` fed back.

Nothing but the folder is needed: manifest.json, the graphs, config.json and the hard-linked
shards. Chunks never split an image run (its first tokens attend to its last ones), so a run
longer than the compiled `seq_len` is refused, naming the `seq_len` it needs.
"""

import os
import sys

import numpy as np

from codegen.verify import open_session, read_manifest
from ref.gemma4.config import VisionConfig
from ref.gemma4.images import expand_prompt, num_soft_tokens, preprocess, prompt_tokens
from ref.gemma4.model import chunk_bounds, image_runs
from ref.gemma4.packing import pack, pack_patches
from ref.gemma4.text_config import TextConfig
from weights import open_checkpoint


class RunError(ValueError):
    """The prompts, images or folder cannot be run with these graphs."""


def _shapes(entry, spec_name):
    """{input name: concrete shape} of a manifest graph entry at one specialization."""
    return {t["name"]: tuple(t["shapes"][spec_name]) for t in entry["inputs"]}


class Runner:
    """The export folder's vision, prefill and decode graphs as onnxruntime sessions."""

    def __init__(self, folder, *, check_shards=True):
        self.folder = os.path.abspath(folder)
        manifest = read_manifest(self.folder, check_shards=check_shards)
        graphs = {g["kind"]: g for g in manifest["graphs"]}
        missing = [k for k in ("prefill", "decode") if k not in graphs]
        if missing:
            raise RunError(
                f"{self.folder} has no {' or '.join(missing)} graph: export with --graphs model"
            )
        self.checkpoint = open_checkpoint(self.folder)
        self.text = TextConfig.from_hf(self.checkpoint.config)
        self.entries = graphs
        self.sessions = {
            kind: open_session(graphs[kind], self.folder, self.checkpoint)
            for kind in ("vision", "prefill", "decode")
            if kind in graphs
        }
        o = graphs["prefill"]["options"]
        self.batch, self.seq_len, self.ctx_len = o["batch_size"], o["seq_len"], o["ctx_len"]
        self.budgets = sorted(o["budgets"])

    def generate(self, prompts, images=(), *, max_new_tokens, log=None):
        """Greedy tokens [len(prompts), max_new_tokens].

        prompts: token-id sequences, each image already a run of image tokens (at most the
        compiled batch_size rows); images: (patches [h·w, 3·p·p] in [0, 1], (h, w)) per image
        run, in order of appearance, row by row.
        """
        log = log or (lambda msg: None)
        rows = [np.asarray(p, np.int64).reshape(-1) for p in prompts]
        self._check(rows, max_new_tokens)
        runs = [image_runs(r, self.text.image_token_id) for r in rows]
        vision_embeds = self._vision(rows, runs, list(images), log)
        schedule = [chunk_bounds(len(row), runs[i], self.seq_len) for i, row in enumerate(rows)]
        for i, row_runs in enumerate(runs):
            for start, n in row_runs:
                if n > self.seq_len:
                    raise RunError(
                        f"row {i}: the image run at {start} has {n} tokens but one prefill chunk "
                        f"holds seq_len={self.seq_len}: export with --seq-len {n} or more "
                        "(a chunk must not split an image run)"
                    )
        caches = self._empty_caches("prefill")
        image_idx = np.zeros((self.batch, 1), np.int32)
        last = [None] * len(rows)
        chunks = max(len(s) for s in schedule)
        for k in range(chunks):
            ids = np.zeros((self.batch, self.seq_len), np.int32)
            pos = np.full((self.batch, self.seq_len), -1, np.int32)
            for i, bounds in enumerate(schedule):
                if k < len(bounds):
                    s, e = bounds[k]
                    ids[i, : e - s], pos[i, : e - s] = rows[i][s:e], np.arange(s, e)
            feed = {"input_ids": ids, "position_ids": pos, **caches}
            if vision_embeds is not None:
                feed.update(vision_embeds=vision_embeds, image_idx=image_idx)
            out = self._run("prefill", feed)
            caches = self._retained(out, caches)
            image_idx = out.get("image_idx_output", image_idx)
            for i, bounds in enumerate(schedule):
                if k == len(bounds) - 1:
                    last[i] = out["logits"][i, 0]
            log(f"prefill chunk {k + 1}/{chunks}")
        token = np.argmax(np.stack(last), axis=-1).astype(np.int32)
        tokens = [token]
        position = np.array([len(r) for r in rows], np.int32)
        for n in range(max_new_tokens - 1):
            ids = np.zeros((self.batch, 1), np.int32)
            pos = np.full((self.batch, 1), -1, np.int32)
            ids[: len(rows), 0], pos[: len(rows), 0] = token, position
            out = self._run("decode", {"input_ids": ids, "position_ids": pos, **caches})
            caches = self._retained(out, caches)
            token = np.argmax(out["logits"][: len(rows), 0], axis=-1).astype(np.int32)
            tokens.append(token)
            position = position + 1
            log(f"decode step {n + 2}/{max_new_tokens}")
        return np.stack(tokens, axis=1)

    def _check(self, rows, max_new_tokens):
        if not 1 <= len(rows) <= self.batch:
            raise RunError(f"{len(rows)} prompts: the graphs take 1 to batch_size={self.batch}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise RunError(f"max_new_tokens={max_new_tokens!r}: expected an int >= 1")
        for i, r in enumerate(rows):
            if len(r) == 0:
                raise RunError(f"row {i}: empty prompt")
            bad = np.flatnonzero((r < 0) | (r >= self.text.vocab_size))
            if bad.size:
                raise RunError(
                    f"row {i}: token id {int(r[bad[0]])} at {int(bad[0])} is outside "
                    f"[0, vocab_size={self.text.vocab_size})"
                )
            if len(r) + max_new_tokens > self.ctx_len:
                raise RunError(
                    f"row {i}: {len(r)} prompt tokens + max_new_tokens={max_new_tokens} exceed "
                    f"ctx_len={self.ctx_len}"
                )

    def _vision(self, rows, runs, images, log):
        """[batch, vision_size, hidden] soft tokens per row (None without vision inputs)."""
        want = sum(len(r) for r in runs)
        if len(images) != want:
            raise RunError(f"{len(images)} images given, the prompts hold {want} image runs")
        prefill_inputs = {t["name"] for t in self.entries["prefill"]["inputs"]}
        if "vision_embeds" not in prefill_inputs:
            if want:
                raise RunError("the prompts hold image runs but the prefill graph takes no images")
            return None
        totals = [sum(n for _, n in r) for r in runs]
        fits = [b for b in self.budgets if b >= max(totals)]
        if not fits:
            raise RunError(
                f"a row holds {max(totals)} image tokens; the largest vision budget exported is "
                f"{self.budgets[-1]}"
            )
        budget = fits[0]
        out = np.zeros((self.batch, budget, self.text.hidden_size), np.float32)
        it = iter(images)
        for i, row_runs in enumerate(runs):
            row_images = [next(it) for _ in row_runs]
            if row_images:
                out[i, : totals[i]] = self._encode(i, row_runs, row_images, budget)[: totals[i]]
                log(f"vision row {i}: {len(row_images)} image(s), {totals[i]} soft tokens")
        return out

    def _encode(self, row, row_runs, row_images, budget):
        """The vision graph on one row's images packed into `budget` soft tokens."""
        if "vision" not in self.sessions:
            raise RunError("images given but the export has no vision graph")
        cfg = VisionConfig.from_hf(self.checkpoint.config)
        k = cfg.pooling_kernel_size
        grids = []
        for (start, n), (_, grid) in zip(row_runs, row_images, strict=True):
            h, w = (int(x) for x in grid)
            if h % k or w % k or (h // k) * (w // k) != n:
                raise RunError(
                    f"row {row}: the image run at {start} has {n} tokens but grid {h}x{w} "
                    f"pools to {(h // k) * (w // k)} (h and w must be multiples of {k})"
                )
            grids.append((h, w))
        packing = pack(
            grids,
            pooling_kernel_size=k,
            position_embedding_size=cfg.position_embedding_size,
            budget=budget,
        )
        patches = pack_patches([p for p, _ in row_images], grids, cfg.patch_dim, packing)
        feed = {
            "pixel_patches": patches,
            "positions": packing.positions,
            "segment_ids": packing.segment_ids,
            "pool_index": packing.pool_index,
        }
        return next(iter(self._run("vision", feed).values()))

    def _empty_caches(self, kind):
        entry = self.entries[kind]
        name = entry["specializations"][0]["name"]
        retained = {pair[0] for pair in entry["retained_state"]}
        shapes = _shapes(entry, name)
        return {n: np.zeros(s, np.float32) for n, s in shapes.items() if n in retained}

    def _run(self, kind, feed):
        session = self.sessions[kind]
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(None, feed), strict=True))

    @staticmethod
    def _retained(out, caches):
        return {n: out[n + "_RetainedState"] for n in caches}


def read_image(path):
    """An image file as [H, W, 3|4] or [H, W] uint8 (what `ref.gemma4.images` takes): RGB, RGBA
    and grayscale as stored, other modes (palette, CMYK, 16-bit) converted by Pillow."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            if img.mode not in ("RGB", "RGBA", "L"):
                alpha = img.mode in ("LA", "PA") or "transparency" in img.info
                img = img.convert("RGBA" if alpha else "RGB")
            return np.asarray(img)
    except (OSError, UnidentifiedImageError) as e:
        raise RunError(f"--image {path}: {e}") from e


def read_tokenizer(folder):
    """The export folder's tokenizer.json (copied from the checkpoint) as a `tokenizers`
    Tokenizer."""
    from tokenizers import Tokenizer

    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise RunError(
            f"--prompt needs {path}: export from a checkpoint folder holding tokenizer.json, "
            "or pass --prompt-ids"
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises its own exception types
        raise RunError(f"{path}: not a readable tokenizer.json ({e})") from e


def default_soft_tokens(runner):
    """The largest exported budget whose image run fits one prefill chunk (else the least)."""
    fits = [b for b in runner.budgets if b <= runner.seq_len]
    return max(fits) if fits else min(runner.budgets, default=70)


def _photo_prompt(args, runner):
    """(prompt ids, images) from --image files and --prompt text or placeholder --prompt-ids."""
    tokens = prompt_tokens(runner.checkpoint.config)
    pixels = [read_image(p) for p in args.image]
    patches, grids, counts = [], [], []
    if pixels:
        cfg = VisionConfig.from_hf(runner.checkpoint.config)
        k = cfg.pooling_kernel_size
        budget = args.max_soft_tokens or default_soft_tokens(runner)
        patches, grids = preprocess(
            pixels, budget, patch_size=cfg.patch_size, pooling_kernel_size=k
        )
        counts = num_soft_tokens(grids, k)
    if args.prompt is not None:
        tokenizer = read_tokenizer(runner.folder)
        text = expand_prompt(args.prompt, counts, tokens=tokens)
        rows = [np.asarray(tokenizer.encode(text).ids)]
    else:
        rows = [expand_prompt(args.prompt_ids[0], counts, tokens=tokens)]
    return rows, list(zip(patches, grids, strict=True)), tokenizer if args.prompt else None


def main(args):
    """`python -m codegen run`: prints progress to stderr and each row's ids, comma-separated,
    as the last lines (after each row's text when a tokenizer is at hand)."""
    if args.skip_shard_check:
        print("run: shards not checked against manifest.json (--skip-shard-check)", file=sys.stderr)
    runner = Runner(args.out, check_shards=not args.skip_shard_check)
    tokenizer = None
    if args.image or args.prompt is not None:
        if args.patches or len(args.prompt_ids or []) > 1:
            raise RunError("--image/--prompt take one prompt row, without --patches")
        if args.prompt is None and not args.prompt_ids:
            raise RunError("--image needs --prompt TEXT or --prompt-ids with image placeholders")
        rows, images, tokenizer = _photo_prompt(args, runner)
    else:
        if not args.prompt_ids:
            raise RunError("give --prompt-ids (or --prompt, or --image with a prompt)")
        if len(args.patches) != len(args.grid):
            raise RunError(
                f"{len(args.patches)} --patches but {len(args.grid)} --grid: one pair each"
            )
        images = []
        for path, grid in zip(args.patches, args.grid, strict=True):
            try:
                patches = np.load(path)
            except (OSError, ValueError) as e:
                raise RunError(f"--patches {path}: {e}") from e
            images.append((np.asarray(patches, np.float32), grid))
        rows = args.prompt_ids
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    tokens = runner.generate(rows, images, max_new_tokens=args.max_new_tokens, log=log)
    for row in tokens:
        if tokenizer is not None:
            print(tokenizer.decode([int(t) for t in row], skip_special_tokens=False))
        print(",".join(str(int(t)) for t in row))
    return 0
