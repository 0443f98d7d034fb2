"""What `python -m codegen run` and `serve` read from the command line — image and video files
(`codegen.media`), the export's tokenizer.json, prompts, patch files, a JSONL file of requests
— turned into what `codegen.runtime.Runner` takes; and the two commands' output."""

import argparse
import json
import os
import sys

import numpy as np

from codegen.media import read_image, read_video
from codegen.runtime import Request, RunError, Runner
from ref.gemma4.config import VisionConfig
from ref.gemma4.images import VIDEO_FRAMES, VIDEO_SOFT_TOKENS
from ref.gemma4.multimodal import prompt_inputs
from ref.gemma4.prompts import prompt_tokens


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
    """(prompt ids, items) from --image and --video files with --prompt text or placeholder
    --prompt-ids (`ref.gemma4.multimodal.prompt_inputs`)."""
    fps = list(args.video_fps)
    if fps and len(fps) != len(args.video):
        raise RunError(f"{len(fps)} --video-fps for {len(args.video)} --video: one each")
    fps += [None] * (len(args.video) - len(fps))
    videos = [read_video(p, args.video_frames, f) for p, f in zip(args.video, fps, strict=True)]
    tokenizer = read_tokenizer(runner.folder) if args.prompt is not None or videos else None
    cfg = VisionConfig.from_hf(runner.checkpoint.config)
    try:
        ids, patches, grids = prompt_inputs(
            args.prompt if args.prompt is not None else args.prompt_ids[0],
            [read_image(p) for p in args.image],
            videos,
            patch_size=cfg.patch_size,
            pooling_kernel_size=cfg.pooling_kernel_size,
            tokens=prompt_tokens(runner.checkpoint.config),
            tokenize=None if tokenizer is None else (lambda s: tokenizer.encode(s).ids),
            max_soft_tokens=args.max_soft_tokens or default_soft_tokens(runner),
            video_soft_tokens=args.video_soft_tokens,
        )
    except ValueError as e:
        raise RunError(str(e)) from e
    items = list(zip(patches, grids, strict=True))
    return [ids], items, tokenizer if args.prompt is not None else None


def _inputs(args, runner):
    """(prompt rows, images, tokenizer or None) from run's options: --image with --prompt or
    placeholder --prompt-ids, or expanded --prompt-ids with --patches/--grid pairs."""
    if args.image or args.video or args.prompt is not None:
        if args.patches or len(args.prompt_ids or []) > 1:
            raise RunError("--image/--video/--prompt take one prompt row, without --patches")
        if args.prompt is None and not args.prompt_ids:
            raise RunError("--image/--video need --prompt TEXT or --prompt-ids with placeholders")
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
    with `images` [image files] and `videos` [frame folders or animations] (with
    `video_fps` [one each], `video_frames` (32), `video_soft_tokens` (70));
    `max_new_tokens` (16) and `arrival` (step, 0). Paths are relative to the file's folder."""
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
            video=[where(p) for p in item.get("videos", [])],
            video_fps=item.get("video_fps", []),
            video_frames=item.get("video_frames", VIDEO_FRAMES),
            video_soft_tokens=item.get("video_soft_tokens", VIDEO_SOFT_TOKENS),
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
