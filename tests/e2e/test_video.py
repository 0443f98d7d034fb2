"""Video prompts end to end against transformers: a prompt with an image and two videos of
different frame sizes (and frame rates, so the timestamps differ) through `Gemma4.generate_from`
in `ref`, and through `python -m codegen run --image F --video DIR|FILE` on the exported graphs
in onnxruntime, gives the tokens `Gemma4ForConditionalGeneration.generate` gives on what
Gemma4Processor makes of the same pixels and text (its video processor stood in for by
tests/hf_video.py: torchvision does not import beside this torch)."""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from codegen.__main__ import main
from codegen.export.command import ExportOptions, export
from codegen.run.media import read_video
from codegen.run.runtime import RunError
from ref.gemma4 import Gemma4
from ref.gemma4.multimodal import prompt_inputs
from tests.hf_processor import WORDS, greedy_with_gap, hf_processor, word_backend, word_tokenizer
from tests.hf_video import VideoStandIn
from tests.text_oracle import hf_model, text_config
from tests.util import examples, save_animation

NEW_TOKENS = 8
MARGIN = 1e-4
BUDGET, PATCH, VIDEO = 70, 2, 7  # "<|video|>" is id 7 of tests/hf_processor.py's SPECIAL
HF_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values")
HF_INPUTS += ("image_position_ids", "pixel_values_videos", "video_position_ids")
HF_INPUTS += ("num_frames_per_video",)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformers model, export folder): a randomized tiny VLM with a video token, saved
    with a tokenizer.json, exported whole with one budget of 70 (a video frame's)."""
    text = text_config(moe=False, layer_types=["sliding_attention", "full_attention"], ple=8)
    model = hf_model(text, seed=23, video_token_id=VIDEO, position_embedding_size=256)
    folder = tmp_path_factory.mktemp("video-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    out = tmp_path_factory.mktemp("video-export") / "out"
    options = dict(budgets=(BUDGET,), seq_len=80, ctx_len=480, hash_shards=False)
    export(ExportOptions(out=out, model=folder, **options), log=lambda msg: None)
    return model, out


def tokenize(text):
    return word_backend().encode(text).ids


@st.composite
def prompts(draw):
    """(text, image, videos [(frames, fps)], num_frames, seed): an image and two videos in a
    drawn order between words, the videos' frames of different sizes."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    num_frames = draw(st.integers(1, 2))
    sizes = draw(st.lists(st.tuples(st.integers(6, 48), st.integers(6, 48)), min_size=3,
                          max_size=3, unique=True))  # fmt: skip
    image = rng.integers(0, 256, (*sizes[0], 3), dtype=np.uint8)
    videos = []
    for size in sizes[1:]:
        total = draw(st.integers(num_frames, num_frames + 4))
        fps = draw(st.sampled_from([None, 10.0, 0.05]))  # 0.05: frames a minute and more apart
        videos.append((rng.integers(0, 256, (total, *size, 3), dtype=np.uint8), fps))
    order = draw(st.permutations(["<|image|>", "<|video|>", "<|video|>"]))
    words = draw(st.lists(st.sampled_from(WORDS[:9]), min_size=3, max_size=3))
    # the prompt ends with its last item: the tiny model's next tokens then depend on it (with
    # words after it, its 6-token sliding window sees only them and greedy tokens barely move)
    text = " ".join(w for pair in zip(words, order, strict=True) for w in pair)
    return text, image, videos, num_frames


def hf_tokens(model, text, image, videos, num_frames):
    """(transformers' generated ids, expanded prompt ids, the least top-2 logit gap); image
    may be None, videos empty."""
    stand_in = VideoStandIn(PATCH, BUDGET, num_frames, [fps for _, fps in videos])
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH, video=stand_in)
    out = processor(
        text=text,
        images=None if image is None else [image],
        videos=[f for f, _ in videos] or None,
        return_tensors="pt",
    )
    inputs = {k: out[k] for k in HF_INPUTS if k in out}
    tokens, gap = greedy_with_gap(model, inputs, NEW_TOKENS)
    return tokens, inputs["input_ids"][0].numpy(), gap


_REFS = {}


def reference_model(folder):
    if folder not in _REFS:
        _REFS[folder] = Gemma4.from_pretrained(folder)
    return _REFS[folder]


@settings(
    max_examples=examples(2),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(prompts())
def test_video_prompt_gives_transformers_tokens(exported, tmp_path_factory, capsys, drawn):
    model, out = exported
    text, image, videos, num_frames = drawn
    want, hf_ids, gap = hf_tokens(model, text, image, videos, num_frames)
    assume(gap > MARGIN)
    ref = reference_model(out)
    sizes = dict(patch_size=PATCH, pooling_kernel_size=3, tokens=ref.tokens)
    ids, _, grids, _ = prompt_inputs(
        text, [image], videos, tokenize=tokenize, max_soft_tokens=BUDGET, num_frames=num_frames,
        **sizes,
    )  # fmt: skip
    np.testing.assert_array_equal(ids, hf_ids)
    assert len(grids) == 1 + 2 * num_frames
    got = ref.generate_from(
        text, [image], videos=videos, max_soft_tokens=BUDGET, num_frames=num_frames,
        tokenize=tokenize, max_new_tokens=NEW_TOKENS,
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)
    # the same through the exported graphs: `codegen run` with the image as a PNG and each
    # video as an animated PNG whose frame duration carries its fps (lossless, unlike GIF)
    folder = tmp_path_factory.mktemp("media")
    Image.fromarray(image).save(folder / "photo.png")
    args = ["run", str(out), "--image", str(folder / "photo.png"), "--prompt", text]
    for i, video in enumerate(videos):
        args += ["--video", str(save_animation(folder / f"clip{i}.png", *video))]
    args += ["--video-frames", str(num_frames), "--max-new-tokens", str(NEW_TOKENS), "--greedy"]
    assert main(args) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)


def test_read_video_keeps_only_the_sampled_frames(tmp_path):
    """A folder of frames (name order) and an animation: the kept frames, their indices, the
    fps (an animation's from its frame duration; --video-fps overrides)."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (7, 5, 4, 3), dtype=np.uint8)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(tmp_path / f"f{i:03d}.png")
    (tmp_path / "notes.txt").write_text("not a frame")
    video = read_video(str(tmp_path), 3)
    np.testing.assert_array_equal(video.index, [0, 2, 4])
    np.testing.assert_array_equal(video.frames, frames[[0, 2, 4]])
    assert video.fps is None and read_video(str(tmp_path), 3, 5.0).fps == 5.0
    path = tmp_path / "clip.png"
    first, *rest = [Image.fromarray(f) for f in frames]
    first.save(path, save_all=True, append_images=rest, default_image=False, duration=250)
    video = read_video(str(path), 2)
    np.testing.assert_array_equal(video.index, [0, 3])
    np.testing.assert_array_equal(video.frames, frames[[0, 3]])
    assert video.fps == 4.0
    with pytest.raises(RunError, match="num_frames=8: expected 1 to the video's 7 frames"):
        read_video(str(path), 8)
    with pytest.raises(RunError, match="no frame images"):
        read_video(str(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else ""), 1)


def test_serve_takes_video_requests(exported, tmp_path_factory, tmp_path, capsys):
    """`serve` over 2 slots, prefilling one at a time: a request with a video, one with an
    image arriving a step later, one with a video and an image; each gets the tokens
    transformers' `generate` gives it alone."""
    model, out = exported
    served = tmp_path_factory.mktemp("video-serve") / "out"
    options = dict(budgets=(BUDGET,), seq_len=80, ctx_len=480, hash_shards=False)
    options |= dict(full_batch_size=2, batch_size=1)
    folder = tmp_path_factory.mktemp("video-serve-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    export(ExportOptions(out=served, model=folder, **options), log=lambda msg: None)
    for seed in range(20):
        rng = np.random.default_rng(seed)
        clips = [(rng.integers(0, 256, (3, 10 + 4 * i, 14, 3), dtype=np.uint8), 10.0 / (i + 1))
                 for i in range(2)]  # fmt: skip
        image = rng.integers(0, 256, (20, 12, 3), dtype=np.uint8)
        asks = [("look at <|video|>", None, clips[:1]), ("this <|image|>", image, []),
                ("<|image|> then <|video|>", image, clips[1:])]  # fmt: skip
        wants = [hf_tokens(model, text, img, vids, 2) for text, img, vids in asks]
        # the video requests' tokens must tell their second frame from their first, so that a
        # chunk given another chunk's soft tokens cannot pass
        repeated = [hf_tokens(model, text, img, [(v[[0, 0, 2]], fps) for v, fps in vids], 2)[0]
                    for text, img, vids in asks]  # fmt: skip
        moved = all(
            (w[0] != r).any() for w, r, a in zip(wants, repeated, asks, strict=True) if a[2]
        )
        if moved and min(gap for _, _, gap in wants) > MARGIN:
            break
    Image.fromarray(image).save(tmp_path / "photo.png")
    lines = []
    for i, (text, img, vids) in enumerate(asks):
        line = {"prompt": text, "max_new_tokens": NEW_TOKENS, "arrival": int(i == 1)}
        if img is not None:
            line["images"] = ["photo.png"]
        if vids:
            line["videos"] = [save_animation(tmp_path / f"clip{i}.png", *vids[0]).name]
            line["video_frames"] = 2
        lines.append(line)
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert main(["serve", str(served), "--requests", str(path), "--greedy"]) == 0
    got = capsys.readouterr().out.splitlines()
    assert got == [f"request {i}: " + ",".join(str(int(t)) for t in want)
                   for i, (want, _, _) in enumerate(wants)]  # fmt: skip


def write_mp4(path, frames, fps):
    """An MPEG-4 Part 2 file of frames [T, H, W, 3] uint8 at fps, written with PyAV."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        container.mux(stream.encode())


@settings(max_examples=examples(3), deadline=None)
@given(st.integers(1, 12), st.integers(0, 12), st.sampled_from([5, 24, 30]), st.integers(0, 99))
def test_video_file_frames_are_transformers_pyav_frames(num_frames, extra, fps, seed):
    """A video file read by PyAV keeps the frames, indices and fps transformers'
    `load_video(backend="pyav")` keeps (both decode the same lossy file); a container that
    does not state its frame count is counted."""
    from transformers.video_utils import load_video

    path = Path(tempfile.mkdtemp()) / "clip.mp4"
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, (num_frames + extra, 32, 48, 3), dtype=np.uint8)
    write_mp4(path, frames, fps)
    video = read_video(str(path), num_frames)
    want, meta = load_video(str(path), num_frames=num_frames, backend="pyav")
    np.testing.assert_array_equal(video.frames, want)
    np.testing.assert_array_equal(video.index, meta.frames_indices)
    assert video.fps == meta.fps == fps
    # Matroska does not state the frame count (transformers then samples from 0 frames): it
    # is counted by decoding, and the same stream gives the same frames
    write_mp4(path.with_suffix(".mkv"), frames, fps)
    counted = read_video(str(path.with_suffix(".mkv")), num_frames)
    np.testing.assert_array_equal(counted.frames, video.frames)
    np.testing.assert_array_equal(counted.index, video.index)
    with pytest.raises(RunError, match="pass --video-frames"):
        read_video(str(path), num_frames + extra + 1)
    (path.parent / "junk.mp4").write_bytes(b"not a video")
    with pytest.raises(RunError, match="junk.mp4"):
        read_video(str(path.parent / "junk.mp4"), 1)
