"""A prompt with images and videos as pixels and audio as samples → what the model takes: the
prompt's token ids with every placeholder expanded, every vision item — an image, or one kept
frame of a video — as patches and a grid, in order of appearance, and the audio clips in order.

ids, patches, grids, audios = prompt_inputs(
    "look <|image|> then <|video|>, hear <|audio|>", [photo], [clip], [samples],
    patch_size=16, pooling_kernel_size=3, tokenize=tokenize)

As transformers' Gemma4Processor and Gemma4Model do (checked in tests/e2e/test_video.py):
- an image becomes `<|image>` + n × `<|image|>` + `<image|>` (n its soft tokens at
  `max_soft_tokens`); a video becomes, per kept frame, `"mm:ss <|image>" + m × "<|video|>"
  + "<image|>"` (m the frame's soft tokens at `video_soft_tokens`, 70 by default; 32 frames
  sampled as `arange(32)·T // 32`; times at the video's fps, 24 when unknown);
- the model fills image tokens with the images' soft tokens and video tokens with the frames'
  soft tokens, each in order: one stream in order of appearance is the same thing, since every
  frame and every image is its own run between `<|image>` and `<image|>`;
- a clip of audio becomes `<|audio>` + n × `<|audio|>` + `<audio|>` (n its soft tokens:
  `ref.gemma4.audio_features.num_soft_tokens`), its soft tokens filling its audio tokens
  (checked in tests/ref/test_audio_prompts.py).

The step takes every soft token of a row as one stream in order of appearance (`soft_rows`):
the image runs' (images and video frames, from the vision tower) and the audio runs' (clips,
from the audio tower), each placeholder filled by the next.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ref import validate
from ref.gemma4.audio_features import check_waveform
from ref.gemma4.audio_features import num_soft_tokens as audio_soft_tokens
from ref.gemma4.images import (
    VIDEO_FRAMES,
    VIDEO_SOFT_TOKENS,
    num_soft_tokens,
    preprocess,
    preprocess_frames,
    preprocess_video,
)
from ref.gemma4.prompts import GEMMA4_TOKENS, expand_prompt
from ref.gemma4.schedule import image_runs


@dataclass(frozen=True)
class Media:
    """How a model's processor reads pixels and samples: `images(images, max_soft_tokens, *,
    patch_size, pooling_kernel_size)` → (patches, grids); `audio(samples, name)` → the clip
    as [n] float32 (refusing what it cannot take); `audio_tokens(n)` → a clip's soft tokens.
    Gemma 4's (`GEMMA4_MEDIA`) and the 12B Unified's (`ref.gemma4.unified_model`)."""

    images: Callable = preprocess
    audio: Callable = check_waveform
    audio_tokens: Callable = audio_soft_tokens


GEMMA4_MEDIA = Media()


@dataclass(frozen=True)
class SampledVideo:
    """A video of which only the kept frames were read: frames [n, H, W, 3] uint8 at `index`
    [n] of the video's frames (`ref.gemma4.images.sample_frames` over its frame count), fps
    its frame rate or None. What a reader of long videos hands over in bounded memory."""

    frames: np.ndarray
    index: np.ndarray
    fps: float | None = None


def video_patches(video, max_soft_tokens, num_frames, *, patch_size, pooling_kernel_size):
    """(patches, grids, timestamps) of one video: [T, H, W, 3] uint8 frames, a pair (frames,
    fps) or a SampledVideo (already sampled: num_frames is not applied again)."""
    sizes = dict(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)
    if isinstance(video, SampledVideo):
        return preprocess_frames(
            video.frames, video.index, max_soft_tokens, video_fps=video.fps, **sizes
        )
    fps = None
    if isinstance(video, tuple):
        if len(video) != 2:
            raise ValueError(f"a video tuple has {len(video)} items: expected (frames, fps)")
        video, fps = video
    return preprocess_video(video, max_soft_tokens, num_frames=num_frames, video_fps=fps, **sizes)


def prompt_inputs(
    prompt,
    images=(),
    videos=(),
    audios=(),
    *,
    patch_size,
    pooling_kernel_size,
    tokens=GEMMA4_TOKENS,
    tokenize=None,
    max_soft_tokens=280,
    video_soft_tokens=VIDEO_SOFT_TOKENS,
    num_frames=VIDEO_FRAMES,
    media=GEMMA4_MEDIA,
):
    """The model's inputs for one prompt with images and videos as pixels.

    prompt: text with one `tokens.image_token` per image and one `tokens.video_token` per video
    (tokenize(str) → ids needed), or token ids with one image/video token id per item
    (tokenize needed for videos: their timestamps are text); images: [H, W, 3|4] or [H, W]
    uint8; videos: [T, H, W, 3] uint8 frames, (frames, fps) pairs or `SampledVideo`s; audios:
    one `tokens.audio_token` each, [n] float samples at 16 kHz, 1 ≤ n ≤ 480,000.
    → (ids [L] int64, patches: list of [h·w, 3·p·p] float32, grids: list of (h, w), one
    patches/grid pair per vision run of ids, in order; audios: the clips as [n] float32, in
    order, each filling the next audio run of ids: a clip of ≤ 160 samples has no run);
    media: the processor's readers (`Media`; Gemma 4's by default).
    """
    audios = [media.audio(a, f"audios[{i}]") for i, a in enumerate(audios)]
    sounds = [media.audio_tokens(len(a)) for a in audios]
    sizes = dict(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)
    image_patches, image_grids = [], []
    if len(images):
        image_patches, image_grids = media.images(images, max_soft_tokens, **sizes)
    frame_patches, frame_grids, clips = [], [], []
    for i, video in enumerate(videos):
        try:
            p, g, times = video_patches(video, video_soft_tokens, num_frames, **sizes)
        except ValueError as e:
            raise ValueError(f"videos[{i}]: {e}") from e
        frame_patches += p
        frame_grids += g
        clips.append((times, num_soft_tokens(g[:1], pooling_kernel_size)[0]))
    counts = num_soft_tokens(image_grids, pooling_kernel_size)
    if isinstance(prompt, str):
        if tokenize is None:
            raise ValueError("a text prompt needs tokenize(str) → token ids")
        text = expand_prompt(prompt, counts, videos=clips, audios=sounds, tokens=tokens)
        ids = np.asarray(tokenize(text), np.int64)
    else:
        ids = expand_prompt(
            prompt, counts, videos=clips, audios=sounds, tokens=tokens, tokenize=tokenize
        )
    runs = [n for _, n in image_runs(ids, tokens.audio_token_id)]
    if runs != [n for n in sounds if n]:
        raise ValueError(
            f"the expanded prompt holds audio runs of {runs} tokens but the clips give "
            f"{sounds} soft tokens (does the tokenizer keep the placeholders as single tokens?)"
        )
    kinds = _run_kinds(ids, tokens)
    for token, n, what in (
        (tokens.image_token_id, len(image_grids), "image"),
        (tokens.video_token_id, len(frame_grids), "video frame"),
    ):
        if kinds.count(token) != n:
            raise ValueError(
                f"the expanded prompt holds {kinds.count(token)} {what} runs but {n} {what}s "
                "are given (does the tokenizer keep the placeholders as single tokens?)"
            )
    items = {
        tokens.image_token_id: iter(zip(image_patches, image_grids, strict=True)),
        tokens.video_token_id: iter(zip(frame_patches, frame_grids, strict=True)),
    }
    ordered = [next(items[kind]) for kind in kinds]
    return ids, [p for p, _ in ordered], [g for _, g in ordered], audios


def _run_kinds(ids, tokens):
    """The placeholder id (image or video token) of each vision run of ids (`image_runs`), in
    order. [L] → list of ints."""
    runs = image_runs(ids, tokens.image_token_id, tokens.video_token_id)
    for a, n in runs:
        if len(set(ids[a : a + n].tolist())) != 1:
            raise ValueError(f"ids {a}…{a + n - 1}: a run mixes image and video tokens")
    return [int(ids[a]) for a, _ in runs]


def soft_runs(ids, vision_ids, audio_ids):
    """(start, length, kind) of each run of placeholders of a row [L], in order: kind "image"
    for a run of `vision_ids` (an image or a video frame), "audio" for one of `audio_ids`."""
    runs = [(a, n, "image") for a, n in image_runs(ids, *vision_ids)]
    return sorted(runs + [(a, n, "audio") for a, n in image_runs(ids, *audio_ids)])


def soft_rows(rows, images, audio, *, hidden, vision_ids, audio_ids=()):
    """Each row's soft tokens in order of appearance, concatenated and zero-padded → [B, V,
    hidden] float32, or None when the rows hold no placeholder.

    rows: B token-id sequences; images: [n_i, hidden] per image run (an image or a video frame)
    in order, row by row; audio: the same per audio run (a clip; clips of no soft tokens are
    skipped: they have no run); vision_ids, audio_ids: the placeholder ids of each kind.
    """
    items = {"image": (images, "images"), "audio": ([a for a in audio if len(a)], "audio clips")}
    runs = [soft_runs(r, vision_ids, audio_ids) for r in rows]
    for kind, (given, plural) in items.items():
        want = sum(k == kind for row in runs for *_, k in row)
        if len(given) != want:
            raise ValueError(f"{len(given)} {plural} given, the prompts hold {want} {kind} runs")
    if not any(runs):
        return None
    taken = {kind: iter(enumerate(given)) for kind, (given, _) in items.items()}
    out = np.zeros((len(rows), max(sum(n for _, n, _ in r) for r in runs), hidden), np.float32)
    for i, row_runs in enumerate(runs):
        at = 0
        for start, n, kind in row_runs:
            j, item = next(taken[kind])
            item = np.asarray(item)
            validate.finite(f"{items[kind][1]}[{j}] (row {i})", item)
            if item.shape != (n, hidden):
                raise ValueError(
                    f"row {i}: the {kind} run at {start} has {n} tokens but its {kind} embeds to "
                    f"{item.shape} (expected [{n}, {hidden}])"
                )
            out[i, at : at + n] = item
            at += n
    return out
