"""A prompt with images and videos as pixels → what the model takes: the prompt's token ids
with every placeholder expanded, and every vision item — an image, or one kept frame of a
video — as patches and a grid, in order of appearance.

ids, patches, grids = prompt_inputs("look <|image|> then <|video|>", [photo], [clip],
                                    patch_size=16, pooling_kernel_size=3, tokenize=tokenize)

As transformers' Gemma4Processor and Gemma4Model do (checked in tests/e2e/test_video.py):
- an image becomes `<|image>` + n × `<|image|>` + `<image|>` (n its soft tokens at
  `max_soft_tokens`); a video becomes, per kept frame, `"mm:ss <|image>" + m × "<|video|>"
  + "<image|>"` (m the frame's soft tokens at `video_soft_tokens`, 70 by default; 32 frames
  sampled as `arange(32)·T // 32`; times at the video's fps, 24 when unknown);
- the model fills image tokens with the images' soft tokens and video tokens with the frames'
  soft tokens, each in order: one stream in order of appearance is the same thing, since every
  frame and every image is its own run between `<|image>` and `<image|>`.
"""

from dataclasses import dataclass

import numpy as np

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
    *,
    patch_size,
    pooling_kernel_size,
    tokens=GEMMA4_TOKENS,
    tokenize=None,
    max_soft_tokens=280,
    video_soft_tokens=VIDEO_SOFT_TOKENS,
    num_frames=VIDEO_FRAMES,
):
    """The model's inputs for one prompt with images and videos as pixels.

    prompt: text with one `tokens.image_token` per image and one `tokens.video_token` per video
    (tokenize(str) → ids needed), or token ids with one image/video token id per item
    (tokenize needed for videos: their timestamps are text); images: [H, W, 3|4] or [H, W]
    uint8; videos: [T, H, W, 3] uint8 frames, (frames, fps) pairs or `SampledVideo`s.
    → (ids [L] int64, patches: list of [h·w, 3·p·p] float32, grids: list of (h, w)), one
    patches/grid pair per vision run of ids, in order.
    """
    sizes = dict(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)
    image_patches, image_grids = [], []
    if len(images):
        image_patches, image_grids = preprocess(images, max_soft_tokens, **sizes)
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
        text = expand_prompt(prompt, counts, videos=clips, tokens=tokens)
        ids = np.asarray(tokenize(text), np.int64)
    else:
        ids = expand_prompt(prompt, counts, videos=clips, tokens=tokens, tokenize=tokenize)
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
    return ids, [p for p, _ in ordered], [g for _, g in ordered]


def _run_kinds(ids, tokens):
    """The placeholder id (image or video token) of each vision run of ids (`image_runs`), in
    order. [L] → list of ints."""
    runs = image_runs(ids, tokens.image_token_id, tokens.video_token_id)
    for a, n in runs:
        if len(set(ids[a : a + n].tolist())) != 1:
            raise ValueError(f"ids {a}…{a + n - 1}: a run mixes image and video tokens")
    return [int(ids[a]) for a, _ in runs]
