"""Gemma 4 audio features in numpy: log-mel frames as transformers' Gemma4AudioFeatureExtractor
makes them, and the number of soft tokens a clip gives.

A clip is 16 kHz mono samples, at most 30 s. It is padded with zeros to a multiple of 128
samples, then 160 zeros are put in front (semicausal: the first frame is centred on t = 0).
Frame i is the 321 samples from i·160, of which the last is dropped (transformers unfolds 321
and keeps 320); the periodic Hann window of 320 multiplies it, `|rfft|` over 512 points gives
257 bins, 128 HTK mel filters over 0–8 kHz (triangles in Hz, no area normalization) project
them, and `log(mel + 1e-3)` is the feature. A frame is valid only where its 321st sample (the
dropped one) is real audio, not padding; invalid frames are zeros.

Precision as transformers has it: samples, the windowed frames and the FFT in float32 (numpy's
pocketfft computes float32 input in float32), the mel projection and the log in float64, the
result stored as float32: equal to transformers' bit for bit (measured on noise, tones, silence
and clipped clips). The 1e-3 floor magnifies the FFT's rounding in quiet bins: a float64 FFT
differs by 7e-4 in the log on a loud pure tone's quiet bins, 1e-6 on noise (measured).
"""

import functools
import math

import numpy as np

SAMPLE_RATE = 16_000
MEL_BINS = 128
FRAME_LENGTH = 320  # 20 ms
HOP_LENGTH = 160  # 10 ms
FFT_LENGTH = 512
MIN_HZ, MAX_HZ = 0.0, 8000.0
MEL_FLOOR = 1e-3
PAD_MULTIPLE = 128  # samples
MAX_SAMPLES = 480_000  # 30 s
LEFT_PAD = FRAME_LENGTH // 2
UNFOLD = FRAME_LENGTH + 1  # samples per frame before the last is dropped
MAX_SOFT_TOKENS = 750  # the processor's audio_seq_length; 30 s give exactly 750


def htk_mel(hz):
    """HTK mel scale: `2595 · log10(1 + hz / 700)`."""
    return 2595.0 * np.log10(1.0 + np.asarray(hz, np.float64) / 700.0)


def htk_hz(mel):
    """Inverse of `htk_mel`."""
    return 700.0 * (np.power(10.0, np.asarray(mel, np.float64) / 2595.0) - 1.0)


@functools.cache
def mel_filter_bank():
    """Triangular HTK filters, rfft bins → mel bins: [FFT_LENGTH // 2 + 1, MEL_BINS] float64.

    Filter m rises from edge m to edge m + 1 and falls to edge m + 2, the MEL_BINS + 2 edges
    evenly spaced in mel over [MIN_HZ, MAX_HZ]; bin b sits at b · (SAMPLE_RATE // 2) / 256 Hz.
    The top filter lies between bins (all zero): transformers has the same.
    """
    edges = htk_hz(np.linspace(htk_mel(MIN_HZ), htk_mel(MAX_HZ), MEL_BINS + 2))
    bins = np.linspace(0, SAMPLE_RATE // 2, FFT_LENGTH // 2 + 1)[:, None]
    rise = (bins - edges[:-2]) / (edges[1:-1] - edges[:-2])
    fall = (edges[2:] - bins) / (edges[2:] - edges[1:-1])
    bank = np.maximum(0.0, np.minimum(rise, fall))
    bank.setflags(write=False)
    return bank


@functools.cache
def hann_window():
    """Periodic Hann window `0.5 − 0.5 · cos(2πn / FRAME_LENGTH)`: [FRAME_LENGTH] float32."""
    n = np.arange(FRAME_LENGTH, dtype=np.float64)
    window = (0.5 - 0.5 * np.cos(2.0 * np.pi * n / FRAME_LENGTH)).astype(np.float32)
    window.setflags(write=False)
    return window


def check_waveform(waveform, name="waveform"):
    """The clip as float32 samples [n], 1 ≤ n ≤ MAX_SAMPLES, finite; ValueError otherwise."""
    x = np.asarray(waveform)
    if x.ndim != 1:
        raise ValueError(f"{name} has shape {x.shape}: expected one channel of samples [n]")
    if x.dtype.kind != "f":
        raise ValueError(
            f"{name} has dtype {x.dtype}: expected float samples in [-1, 1] (integer PCM "
            "scaled, e.g. int16 / 32768)"
        )
    if x.size == 0:
        raise ValueError(f"{name} is empty: expected at least one sample")
    if x.size > MAX_SAMPLES:
        raise ValueError(
            f"{name} has {x.size} samples ({x.size / SAMPLE_RATE:.2f} s): the limit is "
            f"{MAX_SAMPLES} samples ({MAX_SAMPLES // SAMPLE_RATE} s at {SAMPLE_RATE} Hz)"
        )
    bad = ~np.isfinite(x)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}] = {x[i]}: expected finite samples")
    return x.astype(np.float32)


def frame_count(padded_samples):
    """Frames of a padded clip of `padded_samples` samples (before the left pad)."""
    return max((padded_samples + LEFT_PAD - UNFOLD) // HOP_LENGTH + 1, 0)


def valid_frame_count(num_samples):
    """Frames of a clip of `num_samples` samples whose last sample is real audio: frame i ends
    at i·HOP + FRAME_LENGTH after the left pad, real while < LEFT_PAD + num_samples."""
    return max(-(-(num_samples - FRAME_LENGTH + LEFT_PAD) // HOP_LENGTH), 0)


def valid_frames(num_samples, frames):
    """[frames] bool: the first `valid_frame_count(num_samples)` True."""
    return np.arange(frames) < valid_frame_count(num_samples)


def log_mel(waveform, name="waveform"):
    """Log-mel features of one clip, as the feature extractor makes them for that clip alone.

    waveform: [n] float samples at 16 kHz, 1 ≤ n ≤ MAX_SAMPLES (`name` in errors) →
    (features [T, MEL_BINS] float32, mask [T] bool), T = frames of the clip padded to a
    multiple of PAD_MULTIPLE samples; invalid frames are zeros. In a batch, transformers pads
    every clip to the longest one: the clip's frames are the same, followed by more invalid
    ones.
    """
    x = check_waveform(waveform, name)
    n = x.size
    padded = -(-n // PAD_MULTIPLE) * PAD_MULTIPLE
    x = np.pad(x, (LEFT_PAD, padded - n))
    t = frame_count(padded)
    starts = np.arange(t)[:, None] * HOP_LENGTH
    frames = x[starts + np.arange(FRAME_LENGTH)]
    spectrum = np.abs(np.fft.rfft(frames * hann_window(), n=FFT_LENGTH, axis=-1))
    logs = np.log(spectrum @ mel_filter_bank() + MEL_FLOOR)
    mask = valid_frames(n, t)
    return np.where(mask[:, None], logs, 0.0).astype(np.float32), mask


def num_soft_tokens(num_samples):
    """Soft tokens of a clip of `num_samples` samples, as the processor counts them: its valid
    frames, halved (rounding up) by each of the two stride-2 convolutions, at most
    MAX_SOFT_TOKENS (40 ms of audio per token)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer):
        raise ValueError(f"num_samples={num_samples!r}: expected an int")
    if not 1 <= num_samples <= MAX_SAMPLES:
        raise ValueError(f"num_samples={num_samples}: expected 1 to {MAX_SAMPLES} samples")
    tokens = valid_frame_count(int(num_samples))
    for _ in range(2):
        tokens = math.ceil(tokens / 2)
    return min(tokens, MAX_SOFT_TOKENS)
