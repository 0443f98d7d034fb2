"""`run`'s and `serve`'s arguments (`run_parser`, `serve_parser`): the prompt and its images and
videos, and the stop and sampling options both commands share."""

import argparse
from pathlib import Path

from codegen.cli import arguments
from ref.gemma4.images import VIDEO_FRAMES, VIDEO_SOFT_TOKENS


def run_parser(sub):
    """The `run` subcommand, its options in `--help` order."""
    r = sub.add_parser("run", help="generation over an export's vision, prefill and decode graphs")
    r.add_argument("out", type=Path, help="an export folder (written with --graphs model)")
    _prompt_arguments(r)
    r.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate at most (16)")
    _generation_arguments(r)
    r.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (vision, chunks, steps)"
    )
    r.add_argument(
        "--decode-from",
        type=Path,
        metavar="DIR",
        help="disaggregated serving: OUT is a --prefill-only export whose KV cache is handed to "
        "the decode graph of DIR (a --decode-only export with the same cache layout)",
    )
    r.add_argument(
        "--skip-shard-check",
        action="store_true",
        help="do not check the shards' sizes, sha256 and byte ranges against manifest.json "
        "(a shard changed after export then goes unnoticed)",
    )


def serve_parser(sub):
    """The `serve` subcommand, its options in `--help` order."""
    sv = sub.add_parser(
        "serve", help="continuous batching of requests over an export with --full-batch-size"
    )
    sv.add_argument("out", type=Path, help="an export folder (written with --full-batch-size)")
    sv.add_argument(
        "--requests",
        type=Path,
        required=True,
        metavar="FILE.jsonl",
        help="one request a line: {prompt_ids, patches, grids} or {prompt|prompt_ids, images, "
        "videos, video_fps, audios} or {messages} (a conversation, as run's --messages), "
        "thinking (true: as run's --thinking), tools (a list, as run's --tools reads), "
        "max_new_tokens (16), arrival (the step it joins at, 0), chat (as run's --chat), "
        "greedy, sample, temperature, top_k, top_p, seed (each request's own; the options "
        "below are the defaults); a request with thinking or tools also prints its reply as "
        'JSON: "request N reply: {"thought", "answer", "tool_calls"}"',
    )
    _generation_arguments(sv)
    sv.add_argument(
        "--skip-shard-check",
        action="store_true",
        help="do not check the shards against manifest.json",
    )


def _prompt_arguments(r):
    """run's prompt: as text (--prompt with --image, --video, --chat) or as token ids
    (--prompt-ids with --patches and --grid)."""
    r.add_argument(
        "--prompt",
        metavar="TEXT",
        help="the prompt as text, one image placeholder (<|image|>) per --image and one "
        "<|video|> per --video; needs the checkpoint's tokenizer.json (copied into the export "
        "folder)",
    )
    r.add_argument(
        "--system",
        metavar="TEXT",
        help="a system turn before --prompt's user turn (rendered by the chat template)",
    )
    r.add_argument(
        "--messages",
        type=Path,
        metavar="FILE.json",
        help="a conversation instead of --prompt: a JSON list of messages as transformers' "
        "apply_chat_template takes them (role system, user, assistant or tool; content a "
        'string or a list of {"type": "text", "text": ...} and {"type": "image"|"video"|"audio", '
        '"path": FILE} items, paths relative to the file\'s folder), rendered with the '
        "checkpoint's chat template and a generation prompt; its media are read in order as "
        "--image, --video and --audio read them",
    )
    r.add_argument(
        "--thinking",
        action="store_true",
        help="render with the template's enable_thinking=True: the model thinks before it "
        "answers, its thought (<|channel>thought ... <channel|>) printed to stderr after "
        '"thought: ", the answer alone to stdout',
    )
    r.add_argument(
        "--tools",
        type=Path,
        metavar="FILE.json",
        help="tools the model may call: a JSON list of schemas as transformers' "
        'apply_chat_template(tools=) takes them ({"type": "function", "function": {"name", '
        '"description", "parameters"}}); a call it writes (<|tool_call>call:NAME{...}'
        '<tool_call|>) is printed as a line "tool call: {"name": ..., "arguments": {...}}"; '
        "the row stops there at the stop id <|tool_response>",
    )
    r.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="an image file (PNG, JPEG, ...), resized as Gemma 4's image processor does "
        "(repeatable, in the order of the prompt's placeholders)",
    )
    _video_arguments(r)
    r.add_argument(
        "--audio",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="a WAV file (16-bit PCM), or FLAC, MP3, OGG, M4A, a video's sound, … through PyAV "
        "(the video extra): channels averaged, any rate resampled to 16 kHz, at most 30 s; one "
        "<|audio|> placeholder each (repeatable, in the prompt's order); runs through the "
        "export's audio graph",
    )
    r.add_argument(
        "--max-soft-tokens",
        type=int,
        help="soft tokens per --image, one of the exported budgets (default: the largest "
        "exported budget that fits one prefill chunk)",
    )
    r.add_argument(
        "--prompt-ids",
        type=arguments.token_ids,
        action="append",
        metavar="ID,ID,...",
        help="one prompt row's token ids (repeatable: one row each, up to the exported batch "
        "size); with --patches each image already expanded to its run of image tokens, with "
        "--image one image token id per image",
    )
    r.add_argument(
        "--patches",
        type=Path,
        action="append",
        default=[],
        metavar="F.npy",
        help="an image's patches [h·w, 3·p·p] in [0, 1], row-major (repeatable: one per "
        "image run, in order of appearance, row by row)",
    )
    r.add_argument(
        "--grid",
        type=arguments.grid,
        action="append",
        default=[],
        metavar="HxW",
        help="that image's grid in patches (repeatable, paired with --patches in order)",
    )
    r.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="render --prompt with the checkpoint's chat template as one user turn followed by "
        "the model's (Gemma4Processor.apply_chat_template(add_generation_prompt=True)); the "
        "default when the export holds a template; --no-chat sends the text as it is",
    )


def _video_arguments(parser):
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


def _generation_arguments(parser):
    """run's and serve's options of how generation stops and samples: --eos-id, --ignore-eos,
    --greedy, --sample, --temperature, --top-k, --top-p, --seed."""
    parser.add_argument(
        "--eos-id",
        type=arguments.token_ids,
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
        "--greedy",
        action="store_true",
        help="greedy decoding, whatever generation_config.json says (the default where it has "
        "no do_sample true)",
    )
    parser.add_argument(
        "--sample",
        action="store_true",
        help="sample, as generation_config.json's do_sample true does by default, with its "
        "temperature, top_k and top_p unless given (transformers' 1.0, 50, 1.0 where it names "
        "none)",
    )
    parser.add_argument("--temperature", type=float, help="sampling temperature (> 0)")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0: all)")
    parser.add_argument(
        "--top-p", type=float, help="sample from the least set of tokens holding this mass"
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="sampling seed (default: drawn, and printed to stderr); the same seed, the same "
        "tokens",
    )
    parser.add_argument(
        "--stats",
        action="store_true",
        help="print to stderr the bytes that crossed between host and device, per kind of call "
        "(in and out: KV cache, logits, other), per request and per generated token",
    )
    parser.add_argument(
        "--no-speculate",
        dest="speculate",
        action="store_false",
        help="an export with an assistant speculates by default (greedy: a round of K drafts "
        "per speculate call, its acceptance printed per request); this decodes a token per "
        "decode call instead, to compare",
    )
