"""Gemma 4 12B Unified through the exported graphs: `python -m codegen export` on a tiny
gemma4_unified checkpoint writes the embedder graphs in place of the towers (verified in
onnxruntime as it exports), and `python -m codegen run --image F.png --video F.png --audio
F.wav --prompt TEXT` (and `serve` with such requests) gives the tokens transformers'
`generate` gives on what Gemma4UnifiedProcessor makes of the same pixels, frames, samples and
text, speculating with its MTP drafter (`export --assistant`) and
without; `drift` runs its embedder in the device model; the towers' options are refused in
one line."""

import numpy as np
import pytest
from PIL import Image

from codegen.__main__ import main
from codegen.check.drift import DeviceGemma4, random_prompt
from codegen.export.command import ExportOptions, export
from codegen.export.options import ExportError
from ref.gemma4.unified_model import Gemma4Unified
from tests.assistant_oracle import repeating_assistant
from tests.hf_processor import word_backend, word_tokenizer
from tests.hf_unified import HF_INPUTS, VideoStandIn, hf_greedy, hf_unified, unified_processor
from tests.text_oracle import text_config
from tests.util import assert_served, save_animation, serve_requests, write_wav

NEW_TOKENS = 6
MARGIN = 1e-4
BUDGET = 70
FRAMES = 2  # frames kept of a video (`--video-frames`, the processor's num_frames)
LAYERS = ["sliding_attention", "full_attention"]  # hf_unified's decoder (unified_config)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformers model, its folder, export folder): vision budget 70, audio budget 50
    frames, prefill chunks of 70 tokens, 2 continuous-batching slots (`run` and `serve`), and
    its MTP drafter (`export --assistant`: a repeating Gemma4UnifiedAssistantForCausalLM, 2
    drafts a round), so `run` and `serve` speculate unless told `--no-speculate`."""
    model = hf_unified(seed=8)
    folder = tmp_path_factory.mktemp("unified-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    text = text_config(moe=False, layer_types=LAYERS, k_eq_v=True, ple=0)
    table = model.state_dict()["model.language_model.embed_tokens.weight"]
    drafter = repeating_assistant(text, table, LAYERS, unified=True)
    drafter.generation_config.num_assistant_tokens = 2
    assistant = tmp_path_factory.mktemp("unified-assistant")
    drafter.save_pretrained(assistant)
    out = tmp_path_factory.mktemp("unified-export") / "out"
    opts = ExportOptions(out=out, model=folder, assistant=assistant, budgets=(BUDGET,),
                         audio_budgets=(50,), seq_len=BUDGET, ctx_len=256, full_batch_size=2,
                         hash_shards=False)  # fmt: skip
    export(opts, log=lambda m: None)
    return model, folder, out


def files(tmp_path, rng, name, samples, photo=None):
    """A WAV of `samples` 16 kHz samples (and a PNG of `photo` [H, W, 3]) → the clip as the
    runner hears it."""
    ints = rng.integers(-12_000, 12_000, (samples, 1)).astype(np.int16)
    write_wav(tmp_path / f"{name}.wav", ints, 16_000)
    if photo is not None:
        Image.fromarray(photo).save(tmp_path / f"{name}.png")
    return ints[:, 0].astype(np.float32) / 32768


def hf_tokens(model, prompt, images, clips, videos=()):
    """transformers' greedy tokens on Gemma4UnifiedProcessor's output for the prompt, images
    [H, W, 3], clips [n] and videos [(frames [T, H, W, 3], fps)] (FRAMES kept of each)."""
    stand_in = VideoStandIn([fps for _, fps in videos], num_frames=FRAMES) if videos else None
    inputs = unified_processor(word_tokenizer(), BUDGET, stand_in)(
        text=[prompt], images=[images] if images else None, audio=clips or None,
        videos=[f for f, _ in videos] or None, return_tensors="pt",
    )  # fmt: skip
    want, gap = hf_greedy(model, {k: inputs[k] for k in HF_INPUTS if k in inputs}, NEW_TOKENS)
    assert gap > MARGIN, gap
    return want


def video(rng, total, fps):
    """(frames [total, H, W, 3] uint8 of 50–140 px a side, fps)."""
    return rng.integers(0, 256, (total, *rng.integers(50, 141, 2), 3), np.uint8), fps


def test_run_gives_transformers_tokens(exported, tmp_path, capsys):
    model, _, out = exported
    rng = np.random.default_rng(3)
    photo = rng.integers(0, 256, (90, 140, 3), np.uint8)
    clip = files(tmp_path, rng, "a", 2_500, photo)
    prompt = "look <|image|> at <|audio|> then"
    want = hf_tokens(model, prompt, [photo], [clip])
    args = [
        "run",
        str(out),
        "--prompt",
        prompt,
        "--no-chat",
        "--image",
        str(tmp_path / "a.png"),
    ]
    args += ["--audio", str(tmp_path / "a.wav"), "--max-soft-tokens", str(BUDGET)]
    args += ["--max-new-tokens", str(NEW_TOKENS)]
    for speculate in ([], ["--no-speculate"]):  # rounds of the speculate graph, then decode
        assert main([*args, *speculate]) == 0
        out = capsys.readouterr()
        assert out.out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
        assert ("accepted" in out.err) == (not speculate), out.err


def test_run_with_a_video_gives_transformers_tokens(exported, tmp_path, capsys):
    """`run --video F.png --video-frames 2` (an animated PNG whose frame duration carries its
    fps, so the timestamps are transformers') beside a clip: frames sampled and stamped as the
    processor does; the tokens move when the second sampled frame is the first's copy."""
    model, _, out = exported
    rng = np.random.default_rng(4)  # a draw whose tokens follow the frames (most give 59s)
    frames, fps = video(rng, 5, 2.0)
    clip = files(tmp_path, rng, "v", 1_300)
    prompt = "see <|audio|> then <|video|>"
    want = hf_tokens(model, prompt, [], [clip], [(frames, fps)])
    copied = hf_tokens(model, prompt, [], [clip], [(frames[[0, 1, 0, 3, 4]], fps)])  # keeps 0, 2
    assert (copied != want).any(), "the tokens do not see the second frame"
    args = ["run", str(out), "--prompt", prompt, "--no-chat", "--audio", str(tmp_path / "v.wav")]
    args += ["--video", str(save_animation(tmp_path / "v.png", frames, fps))]
    args += ["--video-frames", str(FRAMES), "--max-new-tokens", str(NEW_TOKENS)]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)


def test_serve_requests_get_transformers_tokens(exported, tmp_path):
    """Three requests over 2 slots (an image and a clip; a clip and a video of 2 frames kept
    of 6; two clips), the third waiting for a slot: each gets transformers' tokens for it
    alone."""
    model, _, out = exported
    rng = np.random.default_rng(4)
    photo = rng.integers(0, 256, (60, 50, 3), np.uint8)
    clip = video(np.random.default_rng(0), 6, 3.0)  # its tokens change with its frame 3
    save_animation(tmp_path / "b.png", *clip)
    asks = [("this <|audio|> and <|image|> that", ["a"], ["a.png"], [photo], [1_900], []),
            ("look at <|audio|> then <|video|>", ["b"], [], [], [700], [clip]),
            ("<|audio|> this <|audio|>", ["c", "d"], [], [], [300, 3_100], [])]  # fmt: skip
    lines, wants = [], []
    for prompt, names, pngs, photos, lengths, videos in asks:
        clips = [files(tmp_path, rng, n, k, photos[0] if pngs and i == 0 else None)
                 for i, (n, k) in enumerate(zip(names, lengths, strict=True))]  # fmt: skip
        wants.append(hf_tokens(model, prompt, photos, clips, videos))
        lines.append(dict(prompt=prompt, audios=[f"{n}.wav" for n in names], images=pngs,
                          videos=["b.png"] * len(videos), video_frames=FRAMES, chat=False,
                          max_new_tokens=NEW_TOKENS))  # fmt: skip
    _, (got, timeline) = serve_requests(out, lines, tmp_path)
    assert_served(got, wants, timeline)


def test_drift_runs_its_embedder_in_the_device_model(exported, capsys):
    """`drift` on the export: its row for a prompt with an image of 48-px blocks and the
    agreement over its 3 tokens (float16 compute, MXFP6 weights, mxint8 KV cache).
    Its vision embedder is the device model's: in float32 it is `ref`'s own (equal), in
    float16 it moves by more than float32 rounding and at most 1e-2 of the largest value."""
    _, _, out = exported
    args = ["drift", str(out), "--prompts", "1", "--max-new-tokens", "3", "--mxfp6"]
    assert main([*args, "--kv-dtype", "mxint8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "float32 vs float16 compute, KV cache mxint8, MXFP6 (e2m3) matmul weights"
    assert lines[2].split()[0] == "0", lines
    assert lines[-1].startswith("agreement ") and "/3 = " in lines[-1], lines
    model = Gemma4Unified.from_pretrained(out)
    _, patches, grids = random_prompt(model, np.random.default_rng(0))
    want = model.vision.embed(patches, grids)[0]
    exact = DeviceGemma4(model, "float32", "float32").vision.embed(patches, grids)[0]
    np.testing.assert_array_equal(exact, want)
    half = DeviceGemma4(model, "float16", "float32").vision.embed(patches, grids)[0]
    err = np.max(np.abs(half - want)) / np.max(np.abs(want))
    assert 1e-5 < err <= 1e-2, err


def test_tower_options_are_refused(exported, tmp_path):
    """The towers' export options."""
    _, folder, _ = exported
    for bad, match in (({"vision_tiles": (2, 1)}, "--vision-tiles"),
                       ({"audio_clips": 2}, "--audio-clips")):  # fmt: skip
        opts = ExportOptions(out=tmp_path / "x", model=folder, budgets=(BUDGET,), seq_len=BUDGET,
                             ctx_len=256, hash_shards=False, **bad)  # fmt: skip
        with pytest.raises(ExportError, match=f"{match}.*gemma4_unified has no"):
            export(opts, log=lambda m: None)
