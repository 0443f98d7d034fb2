"""What `python -m codegen run` and `serve` read from the command line — image files, the
export's tokenizer.json, prompts, patch files, a JSONL file of requests — turned into what
`codegen.runtime.Runner` takes; and the two commands' output."""

import argparse
import json
import os
import sys

import numpy as np

from codegen.runtime import Request, RunError, Runner
from ref.gemma4.config import VisionConfig
from ref.gemma4.images import num_soft_tokens, preprocess
from ref.gemma4.prompts import expand_prompt, prompt_tokens


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


def _inputs(args, runner):
    """(prompt rows, images, tokenizer or None) from run's options: --image with --prompt or
    placeholder --prompt-ids, or expanded --prompt-ids with --patches/--grid pairs."""
    if args.image or args.prompt is not None:
        if args.patches or len(args.prompt_ids or []) > 1:
            raise RunError("--image/--prompt take one prompt row, without --patches")
        if args.prompt is None and not args.prompt_ids:
            raise RunError("--image needs --prompt TEXT or --prompt-ids with image placeholders")
        return _photo_prompt(args, runner)
    if not args.prompt_ids:
        raise RunError("give --prompt-ids (or --prompt, or --image with a prompt)")
    if len(args.patches) != len(args.grid):
        raise RunError(f"{len(args.patches)} --patches but {len(args.grid)} --grid: one pair each")
    images = []
    for path, grid in zip(args.patches, args.grid, strict=True):
        try:
            patches = np.load(path)
        except (OSError, ValueError) as e:
            raise RunError(f"--patches {path}: {e}") from e
        images.append((np.asarray(patches, np.float32), grid))
    return args.prompt_ids, images, None


def main(args):
    """`python -m codegen run`: prints progress to stderr and each row's ids, comma-separated,
    as the last lines (after each row's text when a tokenizer is at hand)."""
    if args.skip_shard_check:
        print("run: shards not checked against manifest.json (--skip-shard-check)", file=sys.stderr)
    runner = Runner(
        args.out, check_shards=not args.skip_shard_check, decode_folder=args.decode_from
    )
    rows, images, tokenizer = _inputs(args, runner)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    tokens = runner.generate(rows, images, max_new_tokens=args.max_new_tokens, log=log)
    for row in tokens:
        if tokenizer is not None:
            print(row_text(tokenizer, row))
        print(",".join(str(int(t)) for t in row))
    return 0


def row_text(tokenizer, row):
    """A generated row's decoded text, or a visible note when the ids decode to nothing (ids
    past tokenizer.json's vocabulary, or tokens whose text is empty)."""
    text = tokenizer.decode([int(t) for t in row], skip_special_tokens=False)
    if not text.strip():
        return f"(no text: the {len(row)} ids decode to {text!r})"
    return text


def read_requests(path, runner):
    """Requests from a JSONL file, one object a line: `prompt_ids` (image runs expanded, with
    `patches` [files .npy] and `grids` [[h, w]]) or `prompt` text / placeholder `prompt_ids`
    with `images` [image files]; `max_new_tokens` (16) and `arrival` (step, 0). Paths are
    relative to the file's folder."""
    base = os.path.dirname(os.path.abspath(path))
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise RunError(f"--requests {path}: {e}") from e
    requests = []
    for i, item in enumerate(lines):
        where = lambda p: os.path.join(base, p)  # noqa: E731
        args = argparse.Namespace(
            prompt=item.get("prompt"),
            prompt_ids=[item["prompt_ids"]] if "prompt_ids" in item else None,
            image=[where(p) for p in item.get("images", [])],
            patches=[where(p) for p in item.get("patches", [])],
            grid=[tuple(g) for g in item.get("grids", [])],
            max_soft_tokens=item.get("max_soft_tokens"),
        )
        rows, images, _ = _inputs(args, runner)
        n, arrival = item.get("max_new_tokens", 16), item.get("arrival", 0)
        if not isinstance(arrival, int) or arrival < 0:
            raise RunError(
                f"--requests {path} line {i + 1}: arrival={arrival!r}: expected int >= 0"
            )
        requests.append(Request(np.asarray(rows[0]), images, n, arrival))
    return requests


def serve_main(args):
    """`python -m codegen serve`: continuous batching of a JSONL file of requests; prints the
    step timeline to stderr and each request's ids to stdout."""
    runner = Runner(args.out, check_shards=not args.skip_shard_check)
    requests = read_requests(args.requests, runner)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    tokens, _ = runner.serve(requests, log=log)
    for i, row in enumerate(tokens):
        print(f"request {i}: " + ",".join(str(int(t)) for t in row))
    return 0
