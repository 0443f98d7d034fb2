"""Prompts in: Gemma 4's image and video placeholders expanded as Gemma4Processor does, on
text or on token ids (`expand_prompt`), with the placeholder tokens of a config
(`prompt_tokens`).

- `<|image|>` becomes `<|image>` + n × `<|image|>` + `<image|>` for an image of n soft tokens.
- `<|video|>` becomes `"mm:ss <|image>" + n × "<|video|>" + "<image|>"` per kept frame,
  joined by one space, where mm:ss is ⌊t/60⌋:⌊t mod 60⌋ (two digits each, minutes not
  wrapped) of the frame's time t.

Checked against transformers' Gemma4Processor in tests/ref/test_images.py.
"""

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptTokens:
    """Gemma 4's placeholder strings (tokenizer_config) and ids (Gemma4Config defaults)."""

    image_token: str = "<|image|>"
    boi_token: str = "<|image>"
    eoi_token: str = "<image|>"
    video_token: str = "<|video|>"
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    video_token_id: int = 258_884


GEMMA4_TOKENS = PromptTokens()


def prompt_tokens(hf_config):
    """The PromptTokens of a Gemma 4 config dict: its image/boi/eoi/video ids (the defaults
    where a key is absent), the placeholder strings of Gemma 4's tokenizer."""
    ids = {
        f: int(hf_config[f])
        for f in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id")
        if hf_config.get(f) is not None
    }
    return PromptTokens(**ids)


def timestamp(seconds):
    """mm:ss as Gemma4Processor writes it: ⌊s/60⌋ and ⌊s mod 60⌋, two digits, no hours."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


def _video_text(timestamps, n, tokens):
    frame = f"{tokens.boi_token}{tokens.video_token * n}{tokens.eoi_token}"
    return " ".join(f"{timestamp(t)} {frame}" for t in timestamps)


def _video_ids(timestamps, n, tokens, tokenize):
    frame = [tokens.boi_token_id, *[tokens.video_token_id] * n, tokens.eoi_token_id]
    out = []
    for i, t in enumerate(timestamps):
        out += [*tokenize(f"{' ' if i else ''}{timestamp(t)} "), *frame]
    return out


def _check_counts(found, given, what):
    if found != given:
        raise ValueError(f"the prompt has {found} {what} placeholders but {given} {what}s given")


def expand_prompt(prompt, soft_tokens=(), *, videos=(), tokens=GEMMA4_TOKENS, tokenize=None):
    """Expand image and video placeholders as Gemma4Processor does, on text or on token ids.

    prompt: str with tokens.image_token / tokens.video_token placeholders → the expanded str;
    or a 1-D sequence of ids with image_token_id / video_token_id → [L'] int64.
    soft_tokens: soft tokens of each image in order; videos: (timestamps, soft tokens per frame)
    of each video in order. tokenize(str) → ids is needed for videos in ids: each frame's
    "mm:ss " text is tokenized alone, equal to tokenizing the expanded text when the
    tokenizer does not merge across the text before the placeholder.
    """
    soft_tokens = [int(n) for n in soft_tokens]
    videos = [([float(t) for t in times], int(n)) for times, n in videos]
    if isinstance(prompt, str):
        return _expand_text(prompt, soft_tokens, videos, tokens)
    return _expand_ids(prompt, soft_tokens, videos, tokens, tokenize)


def _expand_text(prompt, soft_tokens, videos, tokens):
    pieces = re.split(f"({re.escape(tokens.image_token)}|{re.escape(tokens.video_token)})", prompt)
    _check_counts(pieces[1::2].count(tokens.image_token), len(soft_tokens), "image")
    _check_counts(pieces[1::2].count(tokens.video_token), len(videos), "video")
    images, clips = iter(soft_tokens), iter(videos)
    for i in range(1, len(pieces), 2):
        if pieces[i] == tokens.image_token:
            n = next(images)
            pieces[i] = f"{tokens.boi_token}{tokens.image_token * n}{tokens.eoi_token}"
        else:
            pieces[i] = _video_text(*next(clips), tokens)
    return "".join(pieces)


def _expand_ids(prompt, soft_tokens, videos, tokens, tokenize):
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"prompt ids have shape {ids.shape} and dtype {ids.dtype}: expected a 1-D "
            "integer sequence (or a str)"
        )
    _check_counts(int(np.sum(ids == tokens.image_token_id)), len(soft_tokens), "image")
    _check_counts(int(np.sum(ids == tokens.video_token_id)), len(videos), "video")
    if videos and tokenize is None:
        raise ValueError("video placeholders in token ids need tokenize(str) → ids")
    images, clips = iter(soft_tokens), iter(videos)
    out = []
    for token in ids.tolist():
        if token == tokens.image_token_id:
            n = next(images)
            out += [tokens.boi_token_id, *[tokens.image_token_id] * n, tokens.eoi_token_id]
        elif token == tokens.video_token_id:
            out += _video_ids(*next(clips), tokens, tokenize)
        else:
            out.append(token)
    return np.asarray(out, dtype=np.int64)
