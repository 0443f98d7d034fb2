"""Images, video and audio in for Gemma 4 12B Unified, in numpy: what
Gemma4UnifiedImageProcessor, Gemma4UnifiedVideoProcessor and
Gemma4UnifiedAudioFeatureExtractor (transformers 5.25) make, without their padding.

- Size: Gemma 4's rule (`ref.gemma4.images.target_size`, budgets 70…1120), sides multiples of
  k·p = 48 px.
- Images: RGB (grayscale repeated) uint8 resized by torchvision's uint8 antialiased bicubic
  (skipped when the size matches; the same arithmetic as the video frames of
  `ref.gemma4.images`), then `x · float32(1/255)` in float32 (the backend's `rescale`), no
  mean or std. RGBA is refused: torchvision composites it in its own float arithmetic.
- Soft tokens: transformers patchifies at 16 px, then `patches_merge` gathers each 3×3 group
  into one (48, 48, 3) block, row-major over the image, at position (column, row) of the
  block grid: that is the image cut into 48-px patches, which is what is done here. The
  processor's padding blocks (zeros at (−1, −1)) are not made at all.
- Video: Gemma 4's sampling and uint8 resize, `float32(x) / 255` (its fused normalize with
  mean 0, std 1), 48-px blocks per frame.
- Audio: the waveform zero-padded to a multiple of 640 samples, cut into 640-sample frames,
  one soft token each: ⌈n / 640⌉ of them, no upper bound.

Checked against transformers' processors in tests/ref/test_unified.py.
"""

import math

import numpy as np

from ref import validate
from ref.gemma4.images import (
    _check_budget,
    _check_sequence,
    _torch_resize_uint8,
    patchify,
    target_size,
    to_rgb,
)
from ref.gemma4.multimodal import Media

SAMPLES_PER_TOKEN = 640  # Gemma4UnifiedAudioFeatureExtractor.audio_samples_per_token
BLOCK = 48  # pixels per side of a soft token: patch 16 · pooling 3
# what `ref.gemma4.images` and `ref.gemma4.multimodal` take to cut 48-px blocks, one soft token
# each: target_size(p=48, k=1) equals target_size(p=16, k=3) (the same budget in pixels, the
# same multiple of 48, the same longest side)
BLOCKS = dict(patch_size=BLOCK, pooling_kernel_size=1)


def _check_block(patch_size, pooling_kernel_size):
    if patch_size * pooling_kernel_size != BLOCK or pooling_kernel_size != 1:
        raise ValueError(
            f"patch_size={patch_size}, pooling_kernel_size={pooling_kernel_size}: Gemma 4 12B "
            f"Unified cuts {BLOCK}-px blocks (expected {BLOCK} and 1)"
        )


def preprocess(images, max_soft_tokens=280, *, patch_size=BLOCK, pooling_kernel_size=1):
    """Gemma4UnifiedImageProcessor without its padding: per image its blocks and grid.

    images: a sequence of uint8 [H, W], [H, W, 1] or [H, W, 3] arrays → (patches: list of
    [h_i·w_i, 6912] float32 in [0, 1], grids: list of (h_i, w_i) in 48-px blocks).
    """
    _check_budget(max_soft_tokens)
    _check_block(patch_size, pooling_kernel_size)
    patches, grids = [], []
    for i, image in enumerate(_check_sequence(images, "images")):
        if np.ndim(image) == 3 and np.shape(image)[-1] == 4:
            raise ValueError(
                f"image {i} has shape {np.shape(image)} (RGBA): expected RGB or grayscale "
                "(composite it on a background first)"
            )
        rgb = to_rgb(image, i)
        size = target_size(*rgb.shape[:2], max_soft_tokens, **BLOCKS)
        resized = rgb if rgb.shape[:2] == size else _torch_resize_uint8(rgb, size)
        pixels = resized.astype(np.float32) * np.float32(1 / 255)
        patches.append(patchify(pixels, BLOCK))
        grids.append((size[0] // BLOCK, size[1] // BLOCK))
    return patches, grids


def check_audio(samples, name="audio"):
    """A clip as [n] float32, refused unless 1-D, finite, n ≥ 1 (no upper bound: the unified
    feature extractor takes any length)."""
    x = np.asarray(samples)
    if x.ndim != 1 or x.size == 0 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(
            f"{name} has shape {x.shape} and dtype {x.dtype}: expected [n ≥ 1] float samples"
        )
    x = x.astype(np.float32)
    validate.finite(name, x)
    return x


def num_audio_tokens(samples):
    """Soft tokens of a clip of `samples` samples: ⌈n / 640⌉."""
    return math.ceil(int(samples) / SAMPLES_PER_TOKEN)


def audio_frames(samples, frame=SAMPLES_PER_TOKEN):
    """A clip [n] → its frames [⌈n / frame⌉, frame] float32, the last zero-padded."""
    x = check_audio(samples)
    pad = -len(x) % frame
    return np.pad(x, (0, pad)).reshape(-1, frame)


def grid_positions(grids):
    """Each item's blocks as (x, y), row-major, items one after another: grids [(h, w), …] in
    blocks → [Σ h·w, 2] int32."""
    out = [np.zeros((0, 2), np.int32)]
    for h, w in grids:
        y, x = np.divmod(np.arange(h * w, dtype=np.int32), w)
        out.append(np.stack([x, y], axis=-1))
    return np.concatenate(out)


# the readers `ref.gemma4.multimodal.prompt_inputs` takes for this model's processor
UNIFIED_MEDIA = Media(images=preprocess, audio=check_audio, audio_tokens=num_audio_tokens)
