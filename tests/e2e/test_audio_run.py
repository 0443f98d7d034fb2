"""Sound and a text prompt in, tokens out: WAV files written here go through `python -m codegen
run OUT --audio F.wav [--image F.png] --prompt TEXT` (the WAV read and resampled to 16 kHz by
`codegen.run.sound`, log-mel features and prompt expansion in `ref`, the exported audio, vision,
prefill and decode graphs in onnxruntime) and give the tokens transformers' `generate` gives on
what its own Gemma4Processor makes of the same samples and text, and so do `serve` requests
with "audios" (WAV and FLAC); bad audio files are one line and exit code 2; the resampler
against an analytic sine."""

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from codegen.__main__ import main
from codegen.check.calibration import recorded_feeds
from codegen.export.command import ExportOptions, export
from codegen.run.commands import read_requests
from codegen.run.runtime import RunError
from codegen.run.sound import resample
from tests.hf_processor import greedy_with_gap, hf_processor, word_backend, word_tokenizer
from tests.text_oracle import hf_audio_vlm
from tests.util import assert_served, examples, serve_requests, write_av, write_wav

NEW_TOKENS = 8
MARGIN = 1e-4
BUDGET, PATCH = 70, 2
SLOTS = 2
CASES = {
    "one clip": "look at <|audio|> then",
    "a clip, an image, a clip": "look <|audio|> at <|image|> this <|audio|> then",
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformers model, export folder): a tiny Gemma 4 with vision and audio, exported
    whole (audio budgets 50 and 188 soft tokens; prefill chunks of 70 so an audio run's part
    in a chunk fits the vision budget) with continuous batching's slots, so `run` and `serve`
    both go through them."""
    model = hf_audio_vlm()
    folder = tmp_path_factory.mktemp("audio-run-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    out = tmp_path_factory.mktemp("audio-run-export") / "out"
    opts = ExportOptions(out=out, model=folder, budgets=(BUDGET,), audio_budgets=(50, 188),
                         seq_len=BUDGET, ctx_len=256, full_batch_size=SLOTS,
                         hash_shards=False)  # fmt: skip
    export(opts, log=lambda m: None)
    return model, out


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=examples(2), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    samples=st.lists(st.integers(400, 12_000), min_size=2, max_size=2),
    rate=st.sampled_from([16_000, 22_050]),
    stereo=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_wav_prompt_gives_transformers_tokens(
    exported, tmp_path_factory, capsys, case, samples, rate, stereo, seed
):
    model, out = exported
    rng = np.random.default_rng(seed)
    folder = tmp_path_factory.mktemp("wav")
    prompt = CASES[case]
    args, clips = ["run", str(out), "--prompt", prompt, "--no-chat"], []
    for i, n in enumerate(samples[: prompt.count("<|audio|>")]):
        ints = rng.integers(-12_000, 12_000, (n, 2 if stereo else 1))
        write_wav(folder / f"{i}.wav", ints, rate, channels=ints.shape[1])
        # what the runner hears: channels averaged, resampled to 16 kHz
        clips.append(resample(ints.astype(np.float32).mean(axis=1) / 32768.0, rate))
        args += ["--audio", str(folder / f"{i}.wav")]
    images = []
    if "<|image|>" in prompt:
        images = [rng.integers(0, 256, (int(rng.integers(8, 40)), 24, 3), np.uint8)]
        Image.fromarray(images[0]).save(folder / "photo.png")
        args += ["--image", str(folder / "photo.png")]
    want, gap = hf_tokens(model, prompt, images, clips)
    assume(gap > MARGIN)
    assert main([*args, "--max-new-tokens", str(NEW_TOKENS), "--greedy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)


def hf_tokens(model, prompt, images, clips):
    """transformers' greedy tokens for `prompt` with its images ([H, W, 3] uint8) and clips ([n]
    float32 at 16 kHz), as Gemma4Processor makes them → (tokens, least top-2 logit gap)."""
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH)
    inputs = processor(text=[prompt], images=[images] if images else None, audio=clips,
                       return_tensors="pt")  # fmt: skip
    return greedy_with_gap(model, inputs, NEW_TOKENS)


# serve's requests: prompt, audio files (name, samples, rate, channels), images, arrival step
REQUESTS = [
    ("look at <|audio|> then", [("a.wav", 6_000, 16_000, 1)], 0, 0),
    ("look <|audio|> at <|image|> this <|audio|> then",
     [("b.flac", 9_000, 22_050, 2), ("c.wav", 3_000, 16_000, 1)], 1, 0),
    ("this <|audio|> and that", [("d.wav", 5_000, 16_000, 2)], 0, 1),
]  # fmt: skip


def test_serve_requests_with_audios_get_transformers_tokens(exported, tmp_path):
    """Requests with "audios" (WAV, and a stereo 22.05 kHz FLAC through PyAV) and an image
    served over 2 slots, the third waiting for one: each gets transformers' tokens for it
    alone; a request naming a missing or a corrupt audio file is refused naming it."""
    model, out = exported
    rng = np.random.default_rng(5)
    lines, wants = [], []
    for prompt, sounds, photos, arrival in REQUESTS:
        clips, images = [], []
        for name, n, rate, channels in sounds:
            ints = rng.integers(-12_000, 12_000, (n, channels)).astype(np.int16)
            if name.endswith(".flac"):
                write_av(tmp_path / name, "flac", ints, rate)
            else:
                write_wav(tmp_path / name, ints, rate, channels=channels)
            clips.append(resample(ints.mean(axis=1) / 32768, rate))
        for i in range(photos):
            images.append(rng.integers(0, 256, (30, 24, 3), np.uint8))
            Image.fromarray(images[-1]).save(tmp_path / f"photo{i}.png")
        want, gap = hf_tokens(model, prompt, images, clips)
        assert gap > MARGIN, gap
        wants.append(want)
        lines.append(dict(prompt=prompt, audios=[s[0] for s in sounds], chat=False,
                          images=[f"photo{i}.png" for i in range(photos)],
                          max_new_tokens=NEW_TOKENS, arrival=arrival))  # fmt: skip
    runner, (got, timeline) = serve_requests(out, lines, tmp_path)
    assert_served(got, wants, timeline)
    path = tmp_path / "requests.jsonl"
    assert any("request 2 joins" in line for line in timeline[2:]), timeline
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk")
    for name, message in [("gone.wav", "No such file or directory: expected an audio file"),
                          ("bad.wav", "not a readable PCM WAV file")]:  # fmt: skip
        path.write_text(
            "\n".join(json.dumps(x) for x in (lines[0], {**lines[0], "audios": [name]}))
        )
        with pytest.raises(RunError, match=re.escape(f"--audio {tmp_path / name}: {message}")):
            read_requests(path, runner)


def test_plan_calibration_runs_the_requests_clips_through_the_audio_graph(exported, tmp_path):
    """`verify --write-npi --prompts FILE` calibrates on each request's graph calls: a request
    with "audios" gives the audio graph's calls (its clips were dropped, and the request refused
    for an audio run without a clip)."""
    _, out = exported
    write_wav(tmp_path / "a.wav", np.random.default_rng(1).integers(-12_000, 12_000, (6_000, 1)),
              16_000)  # fmt: skip
    asks = dict(prompt="look at <|audio|> then", audios=["a.wav"], chat=False, max_new_tokens=1)
    (tmp_path / "asks.jsonl").write_text(json.dumps(asks))
    calls = recorded_feeds(out, tmp_path / "asks.jsonl", check_shards=False)
    assert [label for label, _ in calls["audio"]] == ["request 1 audio 1"]


def _bad_files(folder):
    """(file, what the refusal names) of audio files the runner cannot take."""
    (folder / "empty.wav").write_bytes(b"")
    (folder / "corrupt.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk")
    write_wav(folder / "eight.wav", np.zeros((100, 1)), 16_000, width=1)
    write_wav(folder / "long.wav", np.zeros((16_000 * 30 + 1, 1)), 16_000)
    write_wav(folder / "silent.wav", np.zeros((0, 1)), 16_000)
    write_wav(folder / "three.wav", np.zeros((100, 3)), 16_000, channels=3)
    write_av(folder / "film.mkv", None, None, 0, frames=2)
    return {
        "empty.wav": "not a readable PCM WAV file",
        "corrupt.wav": "not a readable PCM WAV file",
        "eight.wav": "8-bit samples: expected 16-bit PCM WAV",
        "long.wav": "30.00 s: the limit is 30 s",
        "silent.wav": "no samples",
        "three.wav": "3 channels: expected 1 or 2",
        "film.mkv": "no audio stream: expected a file with sound",
    }


def test_bad_audio_files_are_one_line_and_exit_2(exported, tmp_path, capsys):
    _, out = exported
    for name, message in _bad_files(tmp_path).items():
        args = ["run", str(out), "--prompt", "look <|audio|>", "--no-chat"]
        assert main([*args, "--audio", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and name in err[0] and message in err[0], (name, err)


@pytest.mark.parametrize("rate, hz", [(44_100, 440.0), (48_000, 3_000.0), (8_000, 1_000.0),
                                      (11_025, 2_500.0), (16_000, 5_000.0)])  # fmt: skip
def test_resampler_matches_an_analytic_sine(rate, hz):
    """A sine at `rate` resampled to 16 kHz is the sine sampled at 16 kHz (away from the clip's
    ends, where the kernel reads the zeros outside it): measured ≤ 2.1e-5."""
    x = np.sin(2 * np.pi * hz * np.arange(2 * rate) / rate)
    y = resample(x, rate)
    assert len(y) == 32_000
    want = np.sin(2 * np.pi * hz * np.arange(len(y)) / 16_000)
    assert np.abs(y[200:-200] - want[200:-200]).max() < 1e-4


def test_resampler_removes_what_16_khz_cannot_hold():
    """A 10 kHz tone (above 8 kHz Nyquist) at 44.1 kHz resamples to near silence (measured
    3.7e-5), not to its 6 kHz alias."""
    x = np.sin(2 * np.pi * 10_000 * np.arange(44_100) / 44_100)
    assert np.abs(resample(x, 44_100)[200:-200]).max() < 1e-3
