"""Images and video in: Gemma 4's image and video processors in numpy (Pillow only to resize
images). Prompts (placeholder expansion) are `ref.gemma4.prompts`.

patches, grids = preprocess(images, 280)          # what VisionTower.encode(patches, grids) takes
vpatches, vgrids, times = preprocess_video(frames)   # 32 frames, ≤ 70 soft tokens each
n = num_soft_tokens(grids)                         # soft tokens per image (ref.gemma4.prompts)

What transformers 5.24 does (Gemma4ImageProcessorPil, Gemma4VideoProcessor, Gemma4Processor),
matched here and checked in tests/ref/test_images.py:

- Size: the largest (H', W') with sides multiples of k·p (k = pooling 3, p = patch 16) and
  H'·W' ≤ M·k²·p² for the budget M, from `sqrt(M·k²·p² / (H·W))` and floors, in the same
  float64 arithmetic. Past an aspect ratio of about M:1 the short side floors to 0 and the
  image becomes k·p × min(⌊long/short⌋, M)·k·p: squeezed, aspect ratio not kept. Over every
  H, W in 1…4000, budgets 70…1120 and p in {2, 4, 14, 16}, that arithmetic never reaches
  transformers' two errors (a 0×0 target; a target over the budget): any non-empty image
  is accepted and its grid (H'/p, W'/p) holds at most M soft tokens. They stay here as
  ValueErrors all the same.
- Images: uint8 RGB resized by PIL BICUBIC (skipped when the size already matches), then
  `float32(x_float64 · (1/255))`, patchified `(py, px, c)` with channel fastest, patches
  row-major. Grayscale `[H, W, 1]` is repeated to RGB; RGBA is composited on white as
  `rint(a/255·rgb + (1 − a/255)·255)` in float64, as transformers does for arrays.
- Video: frames `arange(n)·T // n` for n = 32 (an error if T < n); each resized by
  torchvision's uint8 antialiased bicubic (not PIL's: the same separable Keys a = −0.5
  filter, horizontal pass first, but int16 weights with a per-axis precision, clamped to
  uint8 after each pass), then `float32(x) / 255`. `_torch_resize_uint8` re-derives that
  arithmetic and equals torchvision 0.29.1 (torch 2.14.1, AVX512 CPU) on all of 20.7M
  values over 300 random size pairs. On noise it differs from PIL's resize on 7.2% of the
  values (94% of those by 1, at most by 28 where Pillow runs its vertical pass first).

Measured and surprising (transformers 5.24, Pillow 13.0):
- A `[H, W, 3]` array with H in {1, 3, 4} is read as channels-first (H channels) unless the
  caller passes `input_data_format="channels_last"`; this module always reads `[H, W, C]`.
- A 2-D `[H, W]` array is refused ("Could not make a flat list of images"); nested once more
  (and read channels-last) it yields 1-channel patches of p² values that the model cannot
  take. Here a 2-D array is grayscale, repeated to RGB like `[H, W, 1]`.
- Float images in [0, 1] are rescaled twice: the output lies in [0, 1/255]. Only uint8 is
  accepted here. An empty image makes transformers divide by zero; here it is a ValueError.
- The video processor ignores a per-call `fps` (with `num_frames=None`) and still samples 32
  frames, because its own default `num_frames=32` fills in after the exclusivity check;
  `fps` sampling only happens for a processor built with `num_frames=None`. Without video
  metadata the timestamps use fps 24.
- Pillow 13.0's BICUBIC does not always run its horizontal pass first: against two uint8 1-D
  passes of its own 22-bit coefficients, 300 random size pairs match only horizontal-first on
  188, only vertical-first on 106, either on 6. So images go through Pillow itself.
"""

import math

import numpy as np
from PIL import Image

BUDGETS = (70, 140, 280, 560, 1120)  # soft tokens per image the processor offers
DEFAULT_BUDGETS = (70, 140)  # those an export writes unless told (`export --budgets`)
VIDEO_FRAMES = 32  # Gemma4VideoProcessor.num_frames
VIDEO_SOFT_TOKENS = 70  # Gemma4VideoProcessor.max_soft_tokens
DEFAULT_VIDEO_FPS = 24.0  # Gemma4Processor's fallback when a video's fps is unknown


def _check_budget(max_soft_tokens):
    if max_soft_tokens not in BUDGETS:
        raise ValueError(f"max_soft_tokens={max_soft_tokens!r}: expected one of {BUDGETS}")


def _check_sizes(patch_size, pooling_kernel_size):
    for name, v in (("patch_size", patch_size), ("pooling_kernel_size", pooling_kernel_size)):
        if not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name}={v!r}: expected a positive integer")


def target_size(height, width, max_soft_tokens=280, *, patch_size=16, pooling_kernel_size=3):
    """Resized (H', W') in pixels for an H×W image: sides multiples of k·p, ≤ M·k² patches."""
    _check_budget(max_soft_tokens)
    _check_sizes(patch_size, pooling_kernel_size)
    if height < 1 or width < 1:
        raise ValueError(f"image size {height}×{width}: expected both sides ≥ 1")
    side = pooling_kernel_size * patch_size
    budget_px = max_soft_tokens * pooling_kernel_size**2 * patch_size**2
    # The same float64 steps as transformers, so the floors agree at every boundary.
    factor = math.sqrt(budget_px / (height * width))
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(
            f"image size {height}×{width}: resizes to 0×0 at {max_soft_tokens} soft tokens"
        )
    longest = max_soft_tokens * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    if h * w > budget_px:
        raise ValueError(
            f"image size {height}×{width}: target {h}×{w} exceeds {max_soft_tokens} soft tokens"
        )
    return h, w


def to_rgb(image, index=0):
    """A uint8 image as RGB: [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] → [H, W, 3] uint8.

    Grayscale is repeated; alpha is composited on white with transformers' float64 rounding.
    """
    image = np.asarray(image)
    if np.issubdtype(image.dtype, np.floating) and not np.all(np.isfinite(image)):
        raise ValueError(f"image {index} has non-finite values: expected uint8 in [0, 255]")
    if image.dtype != np.uint8:
        raise ValueError(
            f"image {index} has dtype {image.dtype}: expected uint8 (floats in [0, 1] would "
            "be rescaled twice by transformers; convert with np.rint(x * 255).astype(uint8))"
        )
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3:
        raise ValueError(
            f"image {index} has shape {image.shape}: expected [H, W] or [H, W, C] (channels last)"
        )
    if image.shape[0] < 1 or image.shape[1] < 1:
        raise ValueError(f"image {index} has shape {image.shape}: expected both sides ≥ 1")
    channels = image.shape[-1]
    if channels == 3:
        return image
    if channels == 1:
        return np.repeat(image, 3, axis=-1)
    if channels == 4:
        alpha = image[..., 3:] / 255.0
        return np.rint(alpha * image[..., :3] + (1 - alpha) * 255.0).astype(np.uint8)
    raise ValueError(
        f"image {index} has {channels} channels (shape {image.shape}): expected 1, 3 or 4"
    )


def resize_pil(image, size):
    """PIL BICUBIC resize, skipped when the size already matches. [H, W, 3] uint8 → [h, w, 3]."""
    h, w = size
    if image.shape[:2] == (h, w):
        return image
    pil = Image.fromarray(np.ascontiguousarray(image))
    return np.asarray(pil.resize((w, h), Image.Resampling.BICUBIC))


def _keys_cubic(x):
    """Keys' cubic convolution with a = −0.5 (PIL's and torch's antialiasing BICUBIC)."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _torch_weights(n_in, n_out):
    """torch's int16 antialias weights for one axis → ([n_out, n_in] integers, precision)."""
    scale = n_in / n_out
    support = 2.0 * scale if scale >= 1.0 else 2.0
    inv = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(n_out) + 0.5)
    lo = np.maximum((center - support + 0.5).astype(np.int64), 0)
    hi = np.minimum((center + support + 0.5).astype(np.int64), n_in)
    j = np.arange(n_in)
    taps = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])
    w = np.where(taps, _keys_cubic((j[None, :] - center[:, None] + 0.5) * inv), 0.0)
    total = np.cumsum(w, axis=1)[:, -1:]  # torch sums the taps in order
    w = np.where(total != 0.0, w / np.where(total != 0.0, total, 1.0), w)
    # The most bits that keep 2·max weight under 2^15 (int16 multiply-add).
    precision = 0
    while precision < 22 and int(0.5 + w.max() * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = w * (1 << precision)
    return np.trunc(np.where(w < 0, scaled - 0.5, scaled + 0.5)), precision


def _torch_pass(image, n_out, axis):
    """One uint8 resampling pass along `axis` of [H, W, C], rounding and clamping to uint8."""
    n_in = image.shape[axis]
    if n_in == n_out:
        return image
    weights, precision = _torch_weights(n_in, n_out)
    x = np.moveaxis(image, axis, -1).astype(np.float64)
    # torch's int32 sums are exact in float64, so BLAS gives the same integers.
    acc = x @ weights.T + (1 << (precision - 1))
    out = np.clip(np.floor(acc / (1 << precision)), 0, 255).astype(np.uint8)
    return np.moveaxis(out, -1, axis)


def _torch_resize_uint8(image, size):
    """torchvision's uint8 antialiased BICUBIC on CPU. [H, W, C] uint8 → [h, w, C] uint8."""
    h, w = size
    return _torch_pass(_torch_pass(image, w, 1), h, 0)


def patchify(image, patch_size):
    """[H, W, C] (sides multiples of p) → [(H/p)·(W/p), p·p·C], (py, px, c) per patch."""
    height, width, channels = image.shape
    h, w = height // patch_size, width // patch_size
    blocks = image.reshape(h, patch_size, w, patch_size, channels).transpose(0, 2, 1, 3, 4)
    return blocks.reshape(h * w, patch_size * patch_size * channels)


def num_soft_tokens(grids, pooling_kernel_size=3):
    """Soft tokens per item: h·w / k² for each (h, w) grid."""
    return [h * w // pooling_kernel_size**2 for h, w in grids]


def _check_sequence(items, what):
    if isinstance(items, np.ndarray):
        raise ValueError(
            f"{what}: got one array of shape {items.shape}; expected a sequence of arrays "
            "(wrap a single image in a list)"
        )
    items = list(items)
    if not items:
        raise ValueError(f"{what}: expected at least one")
    return items


def preprocess(images, max_soft_tokens=280, *, patch_size=16, pooling_kernel_size=3):
    """Gemma 4's image processor: per image [h·w, 3·p·p] float32 in [0, 1] and its (h, w).

    images: a sequence of uint8 [H, W], [H, W, 1], [H, W, 3] or [H, W, 4] arrays →
    (patches: list of [h_i·w_i, 3·p·p] float32, grids: list of (h_i, w_i) in patches).
    """
    _check_budget(max_soft_tokens)
    _check_sizes(patch_size, pooling_kernel_size)
    patches, grids = [], []
    for i, image in enumerate(_check_sequence(images, "images")):
        rgb = to_rgb(image, i)
        size = target_size(
            *rgb.shape[:2],
            max_soft_tokens,
            patch_size=patch_size,
            pooling_kernel_size=pooling_kernel_size,
        )
        pixels = (resize_pil(rgb, size).astype(np.float64) * (1 / 255)).astype(np.float32)
        patches.append(patchify(pixels, patch_size))
        grids.append((size[0] // patch_size, size[1] // patch_size))
    return patches, grids


def sample_frames(total, num_frames=VIDEO_FRAMES, fps=None, video_fps=None):
    """Indices of the kept frames of a T-frame video: `arange(n)·T // n`. → [n] int64.

    n = num_frames, or with num_frames=None and fps given, max(1, ⌊T / video_fps · fps⌋);
    both None keeps every frame.
    """
    if num_frames is not None and fps is not None:
        raise ValueError(
            f"num_frames={num_frames} and fps={fps}: give one of them (num_frames=None for fps)"
        )
    if fps is not None:
        if video_fps is None:
            raise ValueError(f"fps={fps}: sampling by fps needs the video's own video_fps")
        num_frames = max(1, int(total / video_fps * fps))
        if num_frames > total:
            raise ValueError(
                f"fps={fps}: {num_frames} frames from {total} frames at {video_fps} fps; "
                f"expected at most {total}"
            )
    if num_frames is None:
        return np.arange(total, dtype=np.int64)
    if not 1 <= num_frames <= total:
        raise ValueError(f"num_frames={num_frames}: expected 1 to the video's {total} frames")
    return np.arange(num_frames, dtype=np.int64) * total // num_frames


def preprocess_video(
    frames,
    max_soft_tokens=VIDEO_SOFT_TOKENS,
    *,
    num_frames=VIDEO_FRAMES,
    fps=None,
    video_fps=None,
    patch_size=16,
    pooling_kernel_size=3,
):
    """Gemma 4's video processor on one video: the kept frames as patches, grids, timestamps.

    frames: [T, H, W, 3] uint8 → (patches: n × [h·w, 3·p·p] float32, grids: n × (h, w),
    timestamps: n seconds, index / video_fps, with fps 24 when video_fps is None).
    """
    frames = _checked_frames(frames, video_fps)
    index = sample_frames(frames.shape[0], num_frames, fps, video_fps)
    sizes = dict(patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)
    return preprocess_frames(frames[index], index, max_soft_tokens, video_fps=video_fps, **sizes)


def _checked_frames(frames, video_fps):
    """frames as an array, refused unless [T, H, W, 3] with T ≥ 1 and video_fps None or > 0."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ValueError(f"video frames have shape {frames.shape}: expected [T, H, W, 3], T ≥ 1")
    if video_fps is not None and not video_fps > 0:
        raise ValueError(f"video_fps={video_fps!r}: expected a positive frame rate")
    return frames


def preprocess_frames(
    frames,
    index,
    max_soft_tokens=VIDEO_SOFT_TOKENS,
    *,
    video_fps=None,
    patch_size=16,
    pooling_kernel_size=3,
):
    """Gemma 4's video processor on a video's kept frames only (sampled by `sample_frames`
    over its frame count, so a reader need not hold the others): frames [n, H, W, 3] uint8,
    index [n] their indices in the video → as `preprocess_video`."""
    _check_budget(max_soft_tokens)
    _check_sizes(patch_size, pooling_kernel_size)
    frames = _checked_frames(frames, video_fps)
    if frames.dtype != np.uint8:
        raise ValueError(f"video frames have dtype {frames.dtype}: expected uint8")
    if len(index) != len(frames):
        raise ValueError(f"{len(index)} frame indices for {len(frames)} frames: expected one each")
    size = target_size(
        *frames.shape[1:3],
        max_soft_tokens,
        patch_size=patch_size,
        pooling_kernel_size=pooling_kernel_size,
    )
    grid = (size[0] // patch_size, size[1] // patch_size)
    patches = []
    for frame in frames:
        pixels = _torch_resize_uint8(frame, size).astype(np.float32) / np.float32(255)
        patches.append(patchify(pixels, patch_size))
    rate = DEFAULT_VIDEO_FPS if video_fps is None else video_fps
    return patches, [grid] * len(index), [int(t) / rate for t in index]
