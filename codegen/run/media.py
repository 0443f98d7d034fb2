"""Pixels in for `run` and `serve`: image files, and videos — a folder of frame images, an
animated GIF/WebP/PNG (Pillow), or a video file (MP4, MKV, WebM, …: PyAV, the optional
`video` extra, as transformers' `load_video(backend="pyav")` reads it) — of which only the
kept frames are decoded into memory."""

import os

import numpy as np

from codegen.run.errors import RunError
from ref.gemma4.images import VIDEO_FRAMES, sample_frames
from ref.gemma4.multimodal import SampledVideo

FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def read_image(path):
    """An image file as [H, W, 3|4] or [H, W] uint8 (what `ref.gemma4.images` takes): RGB, RGBA
    and grayscale as stored, other modes (palette, CMYK, 16-bit) converted by Pillow."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            if img.mode not in ("RGB", "RGBA", "L"):
                alpha = img.mode in ("LA", "PA") or "transparency" in img.info
                img = img.convert("RGBA" if alpha else "RGB")
            return np.asarray(img)
    except (OSError, UnidentifiedImageError) as e:
        raise RunError(f"--image {path}: {e}") from e


def _rgb(frame):
    """A Pillow frame as [H, W, 3] uint8 (Pillow's RGB conversion: palette expanded, alpha
    dropped; Gemma 4's video processor takes RGB frames)."""
    return np.asarray(frame.convert("RGB"))


def read_video(path, num_frames=VIDEO_FRAMES, fps=None):
    """A video as a SampledVideo: only the `num_frames` kept frames are read, from a folder
    of frame images (name order), an animated image file (Pillow's frames; its frame
    duration gives the fps unless `fps` is given) or a video file (`_read_av`)."""
    from PIL import Image, ImageSequence, UnidentifiedImageError

    try:
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if n.lower().endswith(FRAME_SUFFIXES))
            if not names:
                raise RunError(f"--video {path}: no frame images ({', '.join(FRAME_SUFFIXES)})")
            index = _sampled(path, len(names), num_frames)
            frames = []
            for i in index:
                with Image.open(os.path.join(path, names[i])) as img:
                    frames.append(_rgb(img))
        else:
            try:
                img = Image.open(path)
            except UnidentifiedImageError:  # not an image or animation: a video file
                return _read_av(path, num_frames, fps)
            with img:
                duration = img.info.get("duration")
                rate = fps if fps is not None else (1000 / duration if duration else None)
                index = _sampled(path, getattr(img, "n_frames", 1), num_frames)
                keep = set(index.tolist())
                frames = [_rgb(f) for i, f in enumerate(ImageSequence.Iterator(img)) if i in keep]
                fps = rate
    except (OSError, UnidentifiedImageError) as e:
        raise RunError(f"--video {path}: {e}") from e
    if len({f.shape for f in frames}) != 1:
        shapes = sorted({f.shape[:2] for f in frames})
        raise RunError(f"--video {path}: frames of sizes {shapes}: expected one size")
    return SampledVideo(np.stack(frames), index, fps)


def _sampled(path, total, num_frames):
    """The kept frames' indices of a `total`-frame video (`sample_frames`), refused with the
    option to change."""
    try:
        return sample_frames(total, num_frames)
    except ValueError as e:
        raise RunError(f"--video {path}: {e} (pass --video-frames)") from e


def _read_av(path, num_frames, fps):
    """A video file's kept frames through PyAV, decoded in order and dropped unless kept, as
    transformers' `read_video_pyav` keeps them (frame count and fps from the stream: its
    `frames` and `average_rate`; a stream that does not state its frame count is counted by
    decoding it once)."""
    try:
        import av
    except ImportError as e:
        raise RunError(
            f"--video {path}: not an image Pillow reads; video files need PyAV "
            "(pip install 'gemma4-qaic[video]'), or pass a folder of its frames"
        ) from e
    try:
        with av.open(path) as container:
            stream = container.streams.video[0]
            total = stream.frames
            rate = stream.average_rate
            if not total:
                total = sum(1 for _ in container.decode(video=0))
                container.seek(0)
            index = _sampled(path, total, num_frames)
            keep, frames = set(index.tolist()), []
            for i, frame in enumerate(container.decode(video=0)):
                if i in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
                if i >= index[-1]:
                    break
    except (av.FFmpegError, IndexError) as e:
        raise RunError(f"--video {path}: {e}") from e
    if len(frames) != len(index):
        raise RunError(f"--video {path}: {len(frames)} frames decoded, {total} stated")
    fps = fps if fps is not None else (float(rate) if rate else None)
    return SampledVideo(np.stack(frames), index, fps)
