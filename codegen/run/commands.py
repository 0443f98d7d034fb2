"""What `python -m codegen run` and `serve` read from the command line — image and video files
(`codegen.run.media`), the export's tokenizer.json and chat template (`codegen.run.chat`), prompts,
patch files, tools, stop ids and sampling (`codegen.run.sampling`), a JSONL file of requests —
turned into what `codegen.run.runtime.Runner` takes; and the two commands' output (`run`'s
streamed by `codegen.run.stream`; serve's replies split by `codegen.run.reply`)."""

import argparse
import json
import os
import sys

import numpy as np

from codegen.run import chat, unified
from codegen.run.media import read_image, read_video
from codegen.run.reply import split
from codegen.run.runtime import Request, RunError, Runner
from codegen.run.sampling import KEYS, described, flag, options_of, sampling_of, stop_of
from codegen.run.sound import read_audio
from codegen.run.stream import Stream, row_text
from ref.gemma4.config import VisionConfig
from ref.gemma4.images import VIDEO_FRAMES, VIDEO_SOFT_TOKENS
from ref.gemma4.multimodal import prompt_inputs
from ref.gemma4.prompts import prompt_tokens
from ref.gemma4.unified_media import BLOCKS


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


# what an error names run's --tools and --thinking by (a request: its line's keys)
NAMES = ("--tools", "--thinking")


def _tower_sizes(cfg):
    return {"patch_size": cfg.patch_size, "pooling_kernel_size": cfg.pooling_kernel_size}


def _photo_prompt(args, runner):
    """(prompt ids, items, tokenizer or None, audio clips) from --image, --video and --audio
    files with --prompt text or placeholder --prompt-ids
    (`ref.gemma4.multimodal.prompt_inputs`)."""
    fps = list(args.video_fps)
    if fps and len(fps) != len(args.video):
        raise RunError(f"{len(fps)} --video-fps for {len(args.video)} --video: one each")
    fps += [None] * (len(args.video) - len(fps))
    videos = [read_video(p, args.video_frames, f) for p, f in zip(args.video, fps, strict=True)]
    audios = [read_audio(p) for p in getattr(args, "audio", [])]
    messages, system = getattr(args, "messages", None), getattr(args, "system", None)
    text = args.prompt is not None or messages is not None
    tokenizer = read_tokenizer(runner.folder) if text or videos else None
    config = runner.checkpoint.config
    sizes = BLOCKS if unified.is_unified(config) else _tower_sizes(VisionConfig.from_hf(config))
    tokens = prompt_tokens(config)
    prompt, specials = args.prompt, {}
    try:
        # a conversation or a system turn asks for the template as --chat does
        asked = True if messages is not None or system is not None else getattr(args, "chat", None)
        template = chat_template(asked, runner) if text else None
        tools, thinking = getattr(args, "tools", None), getattr(args, "thinking", False)
        chat.check_options(template, tools, thinking, getattr(args, "names", NAMES))
        if template is not None:
            specials = chat.special_tokens(runner.folder)
            if messages is None:
                message = chat.user_message(
                    prompt, len(args.image), len(videos), tokens, len(audios)
                )
                messages = [chat.system_message(system)] * (system is not None) + [message]
            prompt = chat.render(template, messages, specials, tools=tools, thinking=thinking)
        # transformers adds no special tokens to a rendered text that starts with bos_token
        bare = "bos_token" in specials and prompt.startswith(specials["bos_token"])
        ids, patches, grids, clips = prompt_inputs(
            prompt if prompt is not None else args.prompt_ids[0],
            [read_image(p) for p in args.image],
            videos,
            audios,
            **sizes,
            media=unified.media(config),
            tokens=tokens,
            tokenize=None
            if tokenizer is None
            else (lambda s: tokenizer.encode(s, add_special_tokens=not bare).ids),
            max_soft_tokens=args.max_soft_tokens or default_soft_tokens(runner),
            video_soft_tokens=args.video_soft_tokens,
        )
    except ValueError as e:
        raise RunError(str(e)) from e
    items = list(zip(patches, grids, strict=True))
    return [ids], items, tokenizer if text else None, clips


def chat_template(asked, runner):
    """The template a text prompt is rendered with, or None: as asked (True/False), or, when
    not asked (None), the export's whenever it holds one."""
    if asked is False:
        return None
    template = chat.read_template(runner.folder)
    if template is None and asked:
        raise RunError(
            f"--chat: {runner.folder} holds no chat template (chat_template.jinja, or "
            "chat_template in tokenizer_config.json)"
        )
    return template


def read_run_files(args):
    """run's options with --tools FILE read (`chat.read_tools`) and --messages FILE read
    (`chat.read_messages`; refused beside other prompt options)."""
    if args.tools is not None:
        args = argparse.Namespace(**{**vars(args), "tools": chat.read_tools(args.tools)})
    if args.messages is None:
        return args
    _alone("--messages", _beside_messages(args))
    return argparse.Namespace(**{**vars(args), "messages": chat.read_messages(args.messages)})


def _alone(what, given):
    """Refuse a conversation beside other prompt options: `given` names those present."""
    if given:
        raise RunError(
            f"{what} holds the whole conversation and its media: expected no {', '.join(given)}"
        )


def _beside_messages(args):
    """The prompt options given beside run's --messages (their names)."""
    options = {"--prompt": args.prompt, "--prompt-ids": args.prompt_ids,
               "--patches": args.patches, "--image": args.image, "--video": args.video,
               "--audio": args.audio, "--system": args.system}  # fmt: skip
    given = [name for name, value in options.items() if value not in (None, [])]
    return given + ["--no-chat"] * (args.chat is False)


def _conversation_args(args):
    """The options of a run of messages: their media items as --image, --video and --audio, in
    order of appearance (`chat.media`)."""
    media = {kind: chat.media(args.messages, kind) for kind in chat.MEDIA}
    return argparse.Namespace(
        **{**vars(args), "image": media["image"], "video": media["video"], "audio": media["audio"]}
    )


def inputs(args, runner):
    """(prompt rows, images, tokenizer or None, audio clips) from run's options: --messages, or
    --image, --video, --audio with --prompt (and --system) or placeholder --prompt-ids, or
    expanded --prompt-ids with --patches/--grid pairs."""
    if getattr(args, "messages", None) is not None:
        return _photo_prompt(_conversation_args(args), runner)
    if getattr(args, "system", None) is not None and (args.prompt is None or args.chat is False):
        raise RunError("--system TEXT: expected with --prompt, rendered by the chat template")
    if args.prompt is None:  # ids are not rendered: thinking or tools would be dropped
        chat.check_options(None, getattr(args, "tools", None), getattr(args, "thinking", False),
                           getattr(args, "names", NAMES))  # fmt: skip
    if args.image or args.video or getattr(args, "audio", []) or args.prompt is not None:
        if args.patches or len(args.prompt_ids or []) > 1:
            raise RunError(
                "--image/--video/--audio/--prompt take one prompt row, without --patches"
            )
        if args.prompt is None and not args.prompt_ids:
            raise RunError(
                "--image/--video/--audio need --prompt TEXT or --prompt-ids with placeholders"
            )
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
    return args.prompt_ids, images, None, []


def main(args):
    """`python -m codegen run`: prints progress to stderr (unless --quiet) and how it samples
    (always: the seed repeats a run); with a tokenizer, the row's text streamed to stdout as its
    tokens arrive (with --thinking or --tools split: `codegen.run.stream`); then each row's
    ids, comma-separated and without the padding after a stop id, as the last lines."""
    args = read_run_files(args)
    if args.skip_shard_check:
        print("run: shards not checked against manifest.json (--skip-shard-check)", file=sys.stderr)
    runner = Runner(
        args.out, check_shards=not args.skip_shard_check, decode_folder=args.decode_from,
        speculate=args.speculate,
    )  # fmt: skip
    rows, images, tokenizer, audios = inputs(args, runner)
    quiet = getattr(args, "quiet", False)
    log = None if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        sampling = sampling_of(options_of(args), runner.generation_config, flag)
    except ValueError as e:
        raise RunError(str(e)) from e
    if sampling is not None:
        print(f"run: {described(sampling)} (--seed {sampling.seed} repeats it, --greedy turns "
              "sampling off)", file=sys.stderr, flush=True)  # fmt: skip
    split_reply = args.thinking or args.tools is not None
    stream = Stream(tokenizer, split_reply) if tokenizer is not None and len(rows) == 1 else None
    stop = stop_of(args.eos_id, args.ignore_eos)
    tokens = runner.generate(
        rows,
        images,
        audios=audios,
        max_new_tokens=args.max_new_tokens,
        log=log,
        stop=stop,
        sampling=sampling,
        emit=stream,
    )
    # the stop ids generation used (--ignore-eos: none, so nothing is cut)
    rows = [unpadded(row, runner.stop if stop is None else stop) for row in tokens]
    for row in rows:
        if stream is not None:
            stream.finish(row)
        elif tokenizer is not None:
            print(row_text(tokenizer, row))
        print(",".join(str(int(t)) for t in row))
    print_stats(args, runner, rows)
    return 0


def print_stats(args, runner, rows):
    """With --stats, the runner's host↔device bytes (`codegen.run.device.Transfers.table`) on
    stderr, per request (a row) and per generated token of `rows`."""
    if getattr(args, "stats", False):
        lines = runner.transfers.table(len(rows), sum(len(r) for r in rows))
        print("\n".join(["bytes between host and device:", *lines]), file=sys.stderr)


def unpadded(row, stop):
    """A generated row up to and with its first stop id (the padding after it dropped)."""
    hits = np.flatnonzero(np.isin(row, list(stop)))
    return row if not hits.size else row[: hits[0] + 1]


def read_requests(path, runner, defaults=None):
    """Requests from a JSONL file, one object a line: `prompt_ids` (image runs expanded, with
    `patches` [files .npy] and `grids` [[h, w]]) or `prompt` text / placeholder `prompt_ids`
    with `images` [image files], `videos` [frame folders, animations or video files] (with
    `video_fps` [one each], `video_frames` (32), `video_soft_tokens` (70)) and `audios` [audio
    files: WAV, or any format PyAV decodes], or `messages` (a conversation, as `run --messages`
    reads it) in their place; `thinking` (true: the template's enable_thinking) and `tools` (a
    list of tools, as `run --tools` reads them); `max_new_tokens` (16) and `arrival` (step,
    0); `chat` (`run`'s --chat), `greedy`, `sample`, `temperature`, `top_k`, `top_p`, `seed`
    (default: `defaults`, serve's options; then generation_config.json, `codegen.run.sampling`).
    Paths are relative to the file's folder; any other key is refused."""
    return [request for request, _ in _read_requests(path, runner, defaults)]


# a request's keys: its prompt (those a "messages" conversation replaces first), then the rest
PROMPT_KEYS = ("prompt", "prompt_ids", "patches", "grids", "images", "videos", "audios")
REQUEST_KEYS = (*PROMPT_KEYS, "messages", "max_soft_tokens", "video_fps", "video_frames",
                "video_soft_tokens", "chat", "thinking", "tools", "max_new_tokens", "arrival",
                *KEYS)  # fmt: skip


def _read_requests(path, runner, defaults=None):
    """`read_requests`, each request with the tokenizer that splits its reply (when it asked
    for thinking or tools) or None → list of (Request, tokenizer or None)."""
    base = os.path.dirname(os.path.abspath(path))
    try:
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise RunError(f"--requests {path}: {e}") from e
    return [
        _request(item, f"--requests {path} line {i + 1}", base, runner, defaults)
        for i, item in enumerate(lines)
    ]


def _request(item, where, base, runner, defaults):
    """One line's (Request, tokenizer or None) (see `_read_requests`)."""
    _known(item, where)
    at = lambda p: os.path.join(base, p)  # noqa: E731
    tools = item.get("tools")
    args = argparse.Namespace(
        prompt=item.get("prompt"),
        prompt_ids=[item["prompt_ids"]] if "prompt_ids" in item else None,
        image=[at(p) for p in item.get("images", [])],
        patches=[at(p) for p in item.get("patches", [])],
        grid=[tuple(g) for g in item.get("grids", [])],
        max_soft_tokens=item.get("max_soft_tokens"),
        video=[at(p) for p in item.get("videos", [])],
        audio=[at(p) for p in item.get("audios", [])],
        video_fps=item.get("video_fps", []),
        video_frames=item.get("video_frames", VIDEO_FRAMES),
        video_soft_tokens=item.get("video_soft_tokens", VIDEO_SOFT_TOKENS),
        chat=item.get("chat"),
        messages=_request_messages(item, where, base),
        tools=None if tools is None else chat.parse_tools(tools, f"{where}: tools"),
        thinking=item.get("thinking") is True,
        names=(f"{where}: tools", f"{where}: thinking"),
    )
    rows, images, tokenizer, clips = inputs(args, runner)
    n, arrival = item.get("max_new_tokens", 16), item.get("arrival", 0)
    if not isinstance(arrival, int) or arrival < 0:
        raise RunError(f"{where}: arrival={arrival!r}: expected int >= 0")
    options = {**(defaults or {}), **{k: item[k] for k in KEYS if k in item}}
    try:
        sampling = sampling_of(options, runner.generation_config)
    except ValueError as e:
        raise RunError(f"{where}: {e}") from e
    request = Request(np.asarray(rows[0]), images, n, arrival, sampling, audios=clips)
    return request, tokenizer if args.thinking or args.tools is not None else None


def _known(item, where):
    """Refuse a line that is not an object of REQUEST_KEYS, or whose thinking is not a bool."""
    if not isinstance(item, dict):
        raise RunError(f"{where}: {json.dumps(item)[:60]}: expected a JSON object (a request)")
    unknown = [k for k in item if k not in REQUEST_KEYS]
    if unknown:
        raise RunError(f"{where}: unknown key {unknown[0]!r}: expected keys among "
                       f"{', '.join(REQUEST_KEYS)}")  # fmt: skip
    if not isinstance(item.get("thinking", False), bool):
        raise RunError(f"{where}: thinking={item['thinking']!r}: expected true or false")


def _request_messages(item, where, base):
    """A request's "messages", checked (`chat.parse_messages`, paths relative to `base`), or
    None without them."""
    if "messages" not in item:
        return None
    given = [k for k in PROMPT_KEYS if k in item] + ["chat false"] * (item.get("chat") is False)
    _alone(f"{where}: messages", given)
    return chat.parse_messages(item["messages"], f"{where}: messages", base)


def serve_main(args):
    """`python -m codegen serve`: continuous batching of a JSONL file of requests; prints the
    step timeline and each sampled request's sampling (its seed) to stderr, and each request's
    ids to stdout, after its reply split into thought, answer and tool calls (one line of JSON)
    where it asked for thinking or tools."""
    runner = Runner(args.out, check_shards=not args.skip_shard_check, speculate=args.speculate)
    read = _read_requests(args.requests, runner, options_of(args))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    for i, (request, _) in enumerate(read):
        if request.sampling is not None:
            log(f"request {i}: {described(request.sampling)}")
    requests = [request for request, _ in read]
    tokens, _ = runner.serve(requests, log=log, stop=stop_of(args.eos_id, args.ignore_eos))
    for i, (row, (_, tokenizer)) in enumerate(zip(tokens, read, strict=True)):
        if tokenizer is not None:
            text = tokenizer.decode([int(t) for t in row], skip_special_tokens=False)
            print(f"request {i} reply: " + json.dumps(split(text), ensure_ascii=False))
        print(f"request {i}: " + ",".join(str(int(t)) for t in row))
    print_stats(args, runner, tokens)
    return 0
