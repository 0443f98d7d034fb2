"""Prompts in: Gemma 4's image, video and audio placeholders expanded as Gemma4Processor does,
on text or on token ids (`expand_prompt`), with the placeholder tokens of a config
(`prompt_tokens`).

- `<|image|>` becomes `<|image>` + n × `<|image|>` + `<image|>` for an image of n soft tokens.
- `<|video|>` becomes `"mm:ss <|image>" + n × "<|video|>" + "<image|>"` per kept frame,
  joined by one space, where mm:ss is ⌊t/60⌋:⌊t mod 60⌋ (two digits each, minutes not
  wrapped) of the frame's time t.
- `<|audio|>` becomes `<|audio>` + n × `<|audio|>` + `<audio|>` for a clip of n soft tokens
  (`ref.gemma4.audio_features.num_soft_tokens`; a clip of ≤ 160 samples has none).

Placeholders of every kind may come in any order; each kind takes its items in order. Checked
against transformers' Gemma4Processor in tests/ref/test_images.py and
tests/ref/test_audio_prompts.py.
"""

import re
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PromptTokens:
    """Gemma 4's placeholder strings (tokenizer_config) and ids (Gemma4Config defaults; its
    end-of-audio id is named `eoa_token_index` there)."""

    image_token: str = "<|image|>"
    boi_token: str = "<|image>"
    eoi_token: str = "<image|>"
    video_token: str = "<|video|>"
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    video_token_id: int = 258_884
    audio_token: str = "<|audio|>"
    boa_token: str = "<|audio>"
    eoa_token: str = "<audio|>"
    audio_token_id: int = 258_881
    boa_token_id: int = 256_000
    eoa_token_id: int = 258_883


GEMMA4_TOKENS = PromptTokens()


_IDS = [f for f in PromptTokens.__dataclass_fields__ if f.endswith("_id")]
# a Gemma 4 config key: the PromptTokens field it sets (Gemma4Config says eoa_token_index)
_CONFIG_KEYS = {**{f: f for f in _IDS}, "eoa_token_index": "eoa_token_id"}


def prompt_tokens(hf_config):
    """The PromptTokens of a Gemma 4 config dict: its image/boi/eoi/video/audio/boa/eoa ids (the
    defaults where a key is absent), the placeholder strings of Gemma 4's tokenizer."""
    ids = {
        field: int(hf_config[key])
        for key, field in _CONFIG_KEYS.items()
        if hf_config.get(key) is not None
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


_KINDS = ("image", "video", "audio clip")


def _check_counts(found, given, what):
    if found != given:
        raise ValueError(f"the prompt has {found} {what} placeholders but {given} {what}s given")


def expand_prompt(
    prompt, soft_tokens=(), *, videos=(), audios=(), tokens=GEMMA4_TOKENS, tokenize=None
):
    """Expand image, video and audio placeholders as Gemma4Processor does, on text or on ids.

    prompt: str with tokens.image_token / video_token / audio_token placeholders → the expanded
    str; or a 1-D sequence of ids with image_token_id / video_token_id / audio_token_id →
    [L'] int64.
    soft_tokens: soft tokens of each image in order; videos: (timestamps, soft tokens per frame)
    of each video in order; audios: soft tokens of each audio clip in order. tokenize(str) →
    ids is needed for videos in ids: each frame's "mm:ss " text is tokenized alone, equal to
    tokenizing the expanded text when the tokenizer does not merge across the text before the
    placeholder.
    """
    soft_tokens = [int(n) for n in soft_tokens]
    videos = [([float(t) for t in times], int(n)) for times, n in videos]
    audios = [int(n) for n in audios]
    if isinstance(prompt, str):
        return _expand_text(prompt, soft_tokens, videos, audios, tokens)
    return _expand_ids(prompt, soft_tokens, videos, audios, tokens, tokenize)


def _bracketed(tokens, ids):
    """{placeholder: (opening, closing)} of the kinds that expand to one run of placeholders
    between two marks (images, audio clips): strings, or ids when `ids`."""
    t = tokens
    if ids:
        return {
            t.image_token_id: (t.boi_token_id, t.eoi_token_id),
            t.audio_token_id: (t.boa_token_id, t.eoa_token_id),
        }
    return {t.image_token: (t.boi_token, t.eoi_token), t.audio_token: (t.boa_token, t.eoa_token)}


def _expand_text(prompt, soft_tokens, videos, audios, tokens):
    marks = (tokens.image_token, tokens.video_token, tokens.audio_token)
    pieces = re.split(f"({'|'.join(map(re.escape, marks))})", prompt)
    counts = dict(zip(marks, (soft_tokens, videos, audios), strict=True))
    for mark, what in zip(marks, _KINDS, strict=True):
        _check_counts(pieces[1::2].count(mark), len(counts[mark]), what)
    items = {mark: iter(counts[mark]) for mark in marks}
    runs = _bracketed(tokens, ids=False)
    for i in range(1, len(pieces), 2):
        mark = pieces[i]
        if mark in runs:
            pieces[i] = f"{runs[mark][0]}{mark * next(items[mark])}{runs[mark][1]}"
        else:
            pieces[i] = _video_text(*next(items[mark]), tokens)
    return "".join(pieces)


def _expand_ids(prompt, soft_tokens, videos, audios, tokens, tokenize):
    ids = np.asarray(prompt)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(
            f"prompt ids have shape {ids.shape} and dtype {ids.dtype}: expected a 1-D "
            "integer sequence (or a str)"
        )
    marks = (tokens.image_token_id, tokens.video_token_id, tokens.audio_token_id)
    counts = dict(zip(marks, (soft_tokens, videos, audios), strict=True))
    for mark, what in zip(marks, _KINDS, strict=True):
        _check_counts(int(np.sum(ids == mark)), len(counts[mark]), what)
    if videos and tokenize is None:
        raise ValueError("video placeholders in token ids need tokenize(str) → ids")
    items = {mark: iter(counts[mark]) for mark in marks}
    runs = _bracketed(tokens, ids=True)
    out = []
    for token in ids.tolist():
        if token in runs:
            out += [runs[token][0], *[token] * next(items[token]), runs[token][1]]
        elif token == tokens.video_token_id:
            out += _video_ids(*next(items[token]), tokens, tokenize)
        else:
            out.append(token)
    return np.asarray(out, dtype=np.int64)
