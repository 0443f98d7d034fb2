"""The command line's value readers: each turns one argument's text into its value, or raises
`argparse.ArgumentTypeError` naming the text and what was expected
(`codegen.cli.parser` uses them)."""

import argparse

from ref import moe_modes
from ref.blocking import DENSE_NAMES
from ref.blocking import names as blocking_names
from ref.gemma4.images import VIDEO_FRAMES, VIDEO_SOFT_TOKENS


def int_list(text):
    """Integers from comma-separated text (vision budgets, compute context lengths)."""
    try:
        return tuple(int(b) for b in text.split(",") if b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def tiles(text):
    """(query tiles, KV tiles) from QxKV, or Q for Q×Q."""
    q, _, kv = text.partition("x")
    try:
        return int(q), int(kv or q)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected QxKV or Q, e.g. 5x5") from None


def mode_options(text, known):
    """(mode, {option: value}) from MODE or MODE:opt=value,opt=value."""
    mode, _, rest = text.partition(":")
    if mode not in known:
        raise argparse.ArgumentTypeError(
            f"unknown blocking mode {mode!r}; expected one of {', '.join(known)}"
        )
    options = {}
    for item in rest.split(",") if rest else ():
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: expected option=value")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
        else:
            try:
                options[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r}: expected an integer value") from None
    return mode, options


def blocking_modes(text):
    """An attention graph's MODE[:opt=value,...] (options left out take the mode's defaults in
    `ref.blocking.TABLE`, clipped to the graph's sizes); `all` is every mode and alias with its
    defaults, and `none` (dense)."""
    every = [n for n in blocking_names() if n not in DENSE_NAMES]
    if text == "all":
        return [(m, {}) for m in every] + [("none", {})]
    return [mode_options(text, ["all", *DENSE_NAMES, *every])]


def phase_blocking(text):
    """A model graph's MODE[:opt=value,...] (options left out: the mode's defaults)."""
    return mode_options(text, list(blocking_names(prefill=True)))


def moe_mode(text):
    """An export's MoE mode text (`ref.moe_modes`: dense, gather, nsp[:num_nsp=N,packed_chunk=C]),
    checked here, kept as text: nsp's counts left out are filled in per graph."""
    try:
        moe_modes.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def token_ids(text):
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids") from None


def grid(text):
    h, x, w = text.lower().partition("x")
    if not (x and h.isdigit() and w.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HxW in patches, e.g. 6x9")
    return int(h), int(w)


def graph_kinds(text):
    kinds = tuple(k for k in text.split(",") if k)
    if not kinds or set(kinds) - {"model", "attention"}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected model, attention or model,attention")
    return kinds


def add_video_arguments(parser):
    """run's video options: --video (repeatable), --video-fps, --video-frames,
    --video-soft-tokens."""
    parser.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="DIR|FILE",
        help="a video: a folder of frame images (in name order), an animated GIF/WebP/PNG or "
        "a video file (MP4, MKV, ...: needs PyAV, the 'video' extra), one <|video|> "
        "placeholder each in --prompt (repeatable, in order); only the kept frames are read",
    )
    parser.add_argument(
        "--video-fps",
        type=float,
        action="append",
        default=[],
        metavar="FPS",
        help="each --video's frame rate, in order (default: an animation's own; a folder's "
        "is unknown and its timestamps use 24, as Gemma4Processor does)",
    )
    parser.add_argument(
        "--video-frames",
        type=int,
        default=VIDEO_FRAMES,
        help=f"frames kept per video ({VIDEO_FRAMES}, Gemma 4's video processor's)",
    )
    parser.add_argument(
        "--video-soft-tokens",
        type=int,
        default=VIDEO_SOFT_TOKENS,
        help=f"soft tokens per frame ({VIDEO_SOFT_TOKENS}); an exported budget must hold them",
    )


def add_generation_arguments(parser):
    """run's and serve's options of how generation stops and samples: --eos-id, --ignore-eos,
    --sample, --temperature, --top-k, --top-p, --seed."""
    parser.add_argument(
        "--eos-id",
        type=token_ids,
        metavar="ID,ID,...",
        help="stop ids (default: the checkpoint's generation_config.json eos_token_id, else its "
        "config.json's); a row stops at its first one, which is kept",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="never stop before --max-new-tokens (benchmarks)",
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample instead of greedy decoding, with generation_config.json's temperature, "
        "top_k and top_p unless given (transformers' 1.0, 50, 1.0 where it names none)",
    )
    parser.add_argument("--temperature", type=float, help="sampling temperature (> 0)")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0: all)")
    parser.add_argument(
        "--top-p", type=float, help="sample from the least set of tokens holding this mass"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="sampling seed (0); the same seed, the same tokens"
    )
