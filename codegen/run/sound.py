"""Sound in for `run`: WAV files read with the standard library's `wave` (16-bit PCM, mono or
stereo averaged), resampled to the 16 kHz Gemma 4's feature extractor takes by a windowed-sinc
resampler (`resample`)."""

import struct
import wave

import numpy as np

from codegen.run.errors import RunError
from ref.gemma4.audio_features import MAX_SAMPLES, SAMPLE_RATE

ZEROS = 16  # zero crossings of the sinc each side: the kernel's half width in input periods
BETA = 8.6  # the Kaiser window's shape: stopband ≈ −90 dB
BLOCK = 1 << 14  # output samples computed at a time (bounds the [block, taps] work array)


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
    samples = samples.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
    if not len(samples):
        raise RunError(f"--audio {path}: no samples: expected a clip of 1 sample to 30 s")
    seconds = len(samples) / rate
    if -(-len(samples) * SAMPLE_RATE // rate) > MAX_SAMPLES:
        raise RunError(
            f"--audio {path}: {seconds:.2f} s: the limit is {MAX_SAMPLES // SAMPLE_RATE} s"
        )
    return resample(samples, rate)
