"""Sound in for `run` and `serve`: WAV files read with the standard library's `wave` (16-bit
PCM), other formats (FLAC, MP3, OGG/Opus, M4A/AAC, a video file's sound, …) decoded by PyAV
(the optional `video` extra); channels averaged, then resampled to the 16 kHz Gemma 4's feature
extractor takes by our windowed-sinc resampler (`resample`; never FFmpeg's)."""

import struct
import wave

import numpy as np

from codegen.run.errors import RunError
from ref.gemma4.audio_features import MAX_SAMPLES, SAMPLE_RATE

ZEROS = 16  # zero crossings of the sinc each side: the kernel's half width in input periods
BETA = 8.6  # the Kaiser window's shape: stopband ≈ −90 dB
BLOCK = 1 << 14  # output samples computed at a time (bounds the [block, taps] work array)
LIMIT_S = MAX_SAMPLES // SAMPLE_RATE  # the longest clip, in seconds
WAV_SUFFIXES = (".wav", ".wave")


def resample(x, rate_in, rate_out=SAMPLE_RATE):
    """x [n] float sampled at rate_in → [⌈n · rate_out / rate_in⌉] float32 at rate_out: band-
    limited interpolation with a Kaiser-windowed sinc low-pass at min(rate_in, rate_out) / 2
    (the anti-aliasing filter when downsampling); samples outside the clip are zeros. Output j
    lies at input time j · rate_in / rate_out (the first samples coincide)."""
    x = np.asarray(x, np.float64)
    if x.ndim != 1:
        raise ValueError(f"samples of shape {x.shape}: expected [n]")
    for name, rate in (("rate_in", rate_in), ("rate_out", rate_out)):
        if isinstance(rate, bool) or not isinstance(rate, int) or rate < 1:
            raise ValueError(f"{name}={rate!r}: expected an int >= 1")
    if rate_in == rate_out:
        return x.astype(np.float32)
    n_out = -(-len(x) * rate_out // rate_in)
    cutoff = min(1.0, rate_out / rate_in)  # of the input's Nyquist frequency
    half = ZEROS / cutoff  # the kernel's half width, in input samples
    taps = np.arange(-int(np.ceil(half)), int(np.ceil(half)) + 1)
    # polyphase: output j lies at input time base + p / phases (exact rationals), so the
    # kernel has `phases` distinct shapes, made once
    g = np.gcd(rate_in, rate_out)
    phases = rate_out // g
    t = taps[None, :] - np.arange(phases)[:, None] / phases  # [phases, taps]: k − time
    window = np.i0(BETA * np.sqrt(np.clip(1 - (t / half) ** 2, 0, 1))) / np.i0(BETA)
    kernel = np.where(np.abs(t) < half, cutoff * np.sinc(cutoff * t) * window, 0)
    padded = np.concatenate([np.zeros(len(taps)), x, np.zeros(len(taps))])
    out = np.empty(n_out, np.float64)
    for start in range(0, n_out, BLOCK):
        j = np.arange(start, min(start + BLOCK, n_out))
        base, rem = np.divmod(j * rate_in, rate_out)
        rows = padded[base[:, None] + taps[None, :] + len(taps)]  # zeros outside the clip
        out[j] = np.einsum("jt,jt->j", rows, kernel[rem // g])
    return out.astype(np.float32)


def read_audio(path):
    """An audio file as float32 samples [n] in [−1, 1) at 16 kHz, 1 ≤ n ≤ 30 s: a WAV (by its
    RIFF/WAVE header or its name) through `read_wav`, any other format through `read_av`;
    RunError naming the file and what was expected otherwise."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except OSError as e:
        raise RunError(f"--audio {path}: {e.strerror or e}: expected an audio file") from e
    if head[:4] == b"RIFF" and head[8:] == b"WAVE" or str(path).lower().endswith(WAV_SUFFIXES):
        return read_wav(path)
    return read_av(path)


def read_wav(path):
    """A WAV file as float32 samples [n] in [−1, 1) at 16 kHz: 16-bit PCM, one or two channels
    (averaged), any rate (resampled); at most 30 s, at least one sample. RunError naming the
    file and the value otherwise (an empty file, a corrupt header, another sample width)."""
    try:
        with wave.open(str(path), "rb") as f:
            channels, width, rate, frames = (
                f.getnchannels(),
                f.getsampwidth(),
                f.getframerate(),
                f.getnframes(),
            )
            if width != 2:
                raise RunError(f"--audio {path}: {8 * width}-bit samples: expected 16-bit PCM WAV")
            if channels not in (1, 2):
                raise RunError(f"--audio {path}: {channels} channels: expected 1 or 2")
            data = f.readframes(frames)
    except (wave.Error, EOFError, OSError, RuntimeError, struct.error) as e:
        # `wave` raises RuntimeError for a chunk size past the file, struct.error for a cut one
        why = str(e) or type(e).__name__
        raise RunError(f"--audio {path}: not a readable PCM WAV file ({why})") from e
    samples = np.frombuffer(data[: len(data) // (2 * channels) * 2 * channels], "<i2")
    samples = mono(samples.reshape(-1, channels))
    if _too_long(len(samples), rate):
        raise RunError(f"--audio {path}: {len(samples) / rate:.2f} s: the limit is {LIMIT_S} s")
    return _at_16k(path, samples, rate)


def read_av(path):
    """A file of another format through PyAV: its first audio stream decoded frame by frame,
    each frame's channels averaged (`mono`), resampled by `resample`. RunError naming
    the file: PyAV not installed, no audio stream, not decodable, more than 30 s (decoding
    stops there), no samples."""
    try:
        import av
    except ImportError as e:
        raise RunError(
            f"--audio {path}: not a WAV file; other formats need PyAV "
            "(pip install 'gemma4-qaic[video]'), or convert it to 16-bit PCM WAV"
        ) from e
    parts, rate, count = [], None, 0
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise RunError(f"--audio {path}: no audio stream: expected a file with sound")
            for frame in container.decode(container.streams.audio[0]):
                rate = rate or frame.sample_rate
                if frame.sample_rate != rate:
                    raise RunError(
                        f"--audio {path}: the sample rate changes from {rate} to "
                        f"{frame.sample_rate} Hz: expected one rate"
                    )
                planes = frame.to_ndarray()  # [channels, n] planar, [1, n · channels] packed
                channels = len(frame.layout.channels)
                parts.append(
                    mono(planes.T if frame.format.is_planar else planes.reshape(-1, channels))
                )
                count += len(parts[-1])
                if _too_long(count, rate):
                    raise RunError(f"--audio {path}: over {LIMIT_S} s: the limit is {LIMIT_S} s")
    except av.FFmpegError as e:
        raise RunError(f"--audio {path}: not an audio file PyAV can decode ({e})") from e
    return _at_16k(path, np.concatenate([np.zeros(0, np.float32), *parts]), rate)


def mono(samples):
    """PCM [n, channels] → [n] float32: channels averaged; integers scaled by their full scale
    (int16 / 32768; unsigned about their midpoint), floats kept."""
    x = np.asarray(samples)
    full = 2.0 ** (8 * x.dtype.itemsize - 1) if x.dtype.kind in "iu" else 1.0
    middle = full if x.dtype.kind == "u" else 0.0
    return ((x.mean(axis=1, dtype=np.float64) - middle) / full).astype(np.float32)


def _too_long(count, rate):
    """Whether `count` samples at `rate` resample to more than 30 s at 16 kHz."""
    return -(-count * SAMPLE_RATE // rate) > MAX_SAMPLES


def _at_16k(path, samples, rate):
    """samples [n] float32 at `rate` → [m] float32 at 16 kHz; RunError for none."""
    if not len(samples):
        raise RunError(f"--audio {path}: no samples: expected a clip of 1 sample to {LIMIT_S} s")
    return resample(samples, rate)
