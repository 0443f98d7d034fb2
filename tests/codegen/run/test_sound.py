"""Audio files other than WAV through PyAV (`codegen.run.sound.read_audio`): files encoded here
with PyAV decode to the samples written (FLAC: exactly, as int16; Opus: within its loss),
resample as the WAV path resamples the same samples, and a file with no sound, one PyAV cannot
decode, one over 30 s, or PyAV missing is one RunError naming the file."""

import re
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.run.errors import RunError
from codegen.run.sound import read_audio, resample
from tests.util import examples, write_av, write_wav

pytest.importorskip("av")
LSB = 1 / 32768


@settings(max_examples=examples(3), deadline=None)
@given(
    n=st.integers(1, 6_000),
    channels=st.integers(1, 2),
    rate=st.sampled_from([16_000, 44_100]),
    seed=st.integers(0, 2**31 - 1),
)
def test_flac_decodes_to_the_samples_and_resamples_as_wav(tmp_path_factory, n, channels, rate,
                                                          seed):  # fmt: skip
    """A drawn waveform written as int16 FLAC comes back as written (channels averaged), and
    at 16 kHz within int16 rounding of the waveform; resampled, it is the WAV path's clip."""
    folder = tmp_path_factory.mktemp("flac")
    wave = np.random.default_rng(seed).uniform(-0.9, 0.9, (n, channels))
    ints = np.round(wave * 32768).astype(np.int16)
    write_av(folder / "clip.flac", "flac", ints, rate)
    write_wav(folder / "clip.wav", ints, rate, channels=channels)
    got = read_audio(folder / "clip.flac")
    np.testing.assert_array_equal(got, read_audio(folder / "clip.wav"))
    np.testing.assert_array_equal(got, resample(ints.mean(axis=1) / 32768, rate))
    assert len(got) == -(-n * 16_000 // rate)
    if rate == 16_000:
        assert np.abs(got - wave.mean(axis=1)).max() <= LSB / 2 + 1e-7


def test_a_video_files_sound_and_lossy_opus(tmp_path):
    """The FLAC sound of a Matroska file with a video stream before it decodes exactly; an Opus
    stereo clip (decoded as planar float) at 48 kHz is the resampled waveform within the
    codec's loss (measured 9.3e-3)."""
    t = np.arange(48_000) / 48_000
    wave = 0.5 * np.sin(2 * np.pi * 440 * t)[:, None] * [1.0, 0.5]
    ints = np.round(wave * 32767).astype(np.int16)
    write_av(tmp_path / "film.mkv", "flac", ints[:4_000], 48_000, frames=2)
    np.testing.assert_array_equal(read_audio(tmp_path / "film.mkv"),
                                  resample(ints[:4_000].mean(axis=1) / 32768, 48_000))  # fmt: skip
    write_av(tmp_path / "clip.ogg", "libopus", ints, 48_000)
    got = read_audio(tmp_path / "clip.ogg")
    want = resample(wave.mean(axis=1), 48_000)
    assert len(got) == len(want) and np.abs(got - want).max() < 0.02


def test_unreadable_sound_is_one_error_naming_the_file(tmp_path, monkeypatch):
    write_av(tmp_path / "silent.mkv", None, None, 0, frames=2)
    (tmp_path / "junk.mp3").write_bytes(b"not a sound")
    write_av(tmp_path / "long.flac", "flac", np.zeros((16_000 * 30 + 1, 1), np.int16), 16_000)
    write_av(tmp_path / "empty.flac", "flac", np.zeros((0, 1), np.int16), 16_000)
    cases = {
        "silent.mkv": "no audio stream: expected a file with sound",
        "junk.mp3": "not an audio file PyAV can decode",
        "long.flac": "over 30 s: the limit is 30 s",
        "empty.flac": "no samples: expected a clip of 1 sample to 30 s",
        "gone.ogg": "No such file or directory: expected an audio file",
    }
    for name, message in cases.items():
        with pytest.raises(RunError, match=re.escape(f"--audio {tmp_path / name}: {message}")):
            read_audio(tmp_path / name)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    with pytest.raises(RunError, match=r"long.flac: not a WAV file; .*gemma4-qaic\[video\]"):
        read_audio(tmp_path / "long.flac")
