"""ref.gemma4.images against transformers' Gemma 4 image processor, video processor, processor.

transformers reads a [H, W, 3] array with H in {1, 3, 4} as channels-first, so every call here
passes input_data_format="channels_last" (what ref.gemma4.images always assumes).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gemma4.image_processing_pil_gemma4 import (
    Gemma4ImageProcessorPil,
    get_aspect_ratio_preserving_size,
)
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from ref.gemma4 import images as gi
from ref.gemma4 import prompts as gp
from ref.gemma4.packing import pack, pack_patches
from tests.hf_processor import WORDS, hf_processor, word_tokenizer
from tests.util import examples

LAST = {"input_data_format": "channels_last"}

# Sizes that exercise every branch of the resize rule: tiny, ordinary, 1×N strips and aspect
# ratios past M:1 (where the short side floors to zero), both orientations.
sizes = st.one_of(
    st.tuples(st.integers(1, 8), st.integers(1, 8)),
    st.tuples(st.integers(1, 300), st.integers(1, 300)),
    st.tuples(st.integers(1, 3), st.integers(1, 3000)),
    st.tuples(st.integers(1, 40), st.integers(300, 3000)),
).flatmap(lambda hw: st.sampled_from([hw, hw[::-1]]))


def random_image(seed, height, width, channels):
    """[H, W, C] uint8 noise, or [H, W] for channels=0."""
    shape = (height, width) if channels == 0 else (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def hf_unpad(pixel_values, position_ids):
    """transformers' padded rows → (patches [h·w, F], (h, w)), checking row-major order."""
    real = position_ids[:, 0] >= 0
    n = int(real.sum())
    assert real[:n].all(), "padding rows must come after the real ones"
    h, w = int(position_ids[:n, 1].max()) + 1, int(position_ids[:n, 0].max()) + 1
    xs, ys = np.meshgrid(np.arange(w), np.arange(h), indexing="xy")
    np.testing.assert_array_equal(position_ids[:n], np.stack([xs, ys], -1).reshape(n, 2))
    return pixel_values[:n], (h, w)


def hf_preprocess(images, max_soft_tokens, patch_size):
    proc = Gemma4ImageProcessorPil(
        patch_size=patch_size, max_soft_tokens=max_soft_tokens, pooling_kernel_size=3
    )
    out = proc(list(images), return_tensors="np", **LAST)
    pairs = [
        hf_unpad(v, p) for v, p in zip(out["pixel_values"], out["image_position_ids"], strict=True)
    ]
    soft = [h * w // 9 for _, (h, w) in pairs]
    assert soft == list(out["num_soft_tokens_per_image"])
    return [p for p, _ in pairs], [g for _, g in pairs]


def assert_same(mine, theirs):
    (patches, grids), (hf_patches, hf_grids) = mine, theirs
    assert grids == hf_grids
    for ours, hf in zip(patches, hf_patches, strict=True):
        assert ours.dtype == np.float32 and ours.shape == hf.shape
        np.testing.assert_allclose(ours, hf, rtol=0, atol=1e-6)


@settings(max_examples=examples(150))
@given(
    st.lists(
        st.tuples(sizes, st.sampled_from([1, 3, 4]), st.integers(0, 2**32 - 1)),
        min_size=1,
        max_size=2,
    ),
    st.sampled_from(gi.BUDGETS),
    st.sampled_from([16, 2, 4]),
)
def test_preprocess_matches_transformers(items, budget, patch_size):
    images = [random_image(seed, h, w, c) for (h, w), c, seed in items]
    patches, grids = gi.preprocess(images, budget, patch_size=patch_size)
    assert_same((patches, grids), hf_preprocess(images, budget, patch_size))
    for p, (h, w) in zip(patches, grids, strict=True):
        assert h % 3 == 0 and w % 3 == 0 and 0 < h * w <= budget * 9
        assert p.shape == (h * w, 3 * patch_size**2) and 0.0 <= p.min() and p.max() <= 1.0
    packing = pack(grids, budget=budget * len(grids))  # what VisionTower.encode accepts
    pack_patches(patches, grids, 3 * patch_size**2, packing)


@settings(max_examples=examples(10))
@given(
    st.sampled_from([(4000, 30), (30, 4000), (2000, 1500), (1, 4000)]),
    st.sampled_from(gi.BUDGETS),
)
def test_huge_images_match_transformers(size, budget):
    image = random_image(sum(size), *size, 3)
    assert_same(gi.preprocess([image], budget), hf_preprocess([image], budget, 16))


@settings(max_examples=examples(300))
@given(
    st.integers(1, 100_000),
    st.integers(1, 100_000),
    st.sampled_from(gi.BUDGETS),
    st.integers(1, 32),
)
def test_target_size_matches_transformers(height, width, budget, patch_size):
    try:
        expected = get_aspect_ratio_preserving_size(height, width, patch_size, budget * 9, 3)
    except ValueError:
        with pytest.raises(ValueError, match=f"{height}×{width}"):
            gi.target_size(height, width, budget, patch_size=patch_size)
        return
    assert gi.target_size(height, width, budget, patch_size=patch_size) == expected


def test_aspect_past_budget_is_squeezed_to_exactly_the_budget():
    # 1×1000 at 70 tokens: the short side floors to 0, so 48 × 70·48, not 1:1000.
    assert gi.target_size(1, 1000, 70) == (48, 70 * 48)
    assert gi.target_size(1000, 1, 70) == (70 * 48, 48)


@settings(max_examples=examples(20))
@given(sizes, st.integers(0, 2**32 - 1))
def test_grayscale_2d_is_converted_like_one_channel(size, seed):
    # transformers refuses a 2-D array; its [H, W, 1] conversion is the one matched.
    gray = random_image(seed, *size, 0)
    assert_same(gi.preprocess([gray], 70), hf_preprocess([gray[..., None]], 70, 16))


def test_rgba_is_composited_on_white():
    rgba = np.zeros((96, 96, 4), np.uint8)
    rgba[:48, :, :3] = 10
    rgba[:48, :, 3] = 255
    rgb = gi.to_rgb(rgba)
    assert (rgb[:48] == 10).all() and (rgb[48:] == 255).all()
    assert_same(gi.preprocess([rgba], 70), hf_preprocess([rgba], 70, 16))


image = random_image(0, 50, 60, 3)
ERRORS = {
    "budget": ([image], 100, "max_soft_tokens=100"),
    "two channels": ([random_image(0, 50, 60, 2)], 70, "2 channels"),
    "five channels": ([random_image(0, 50, 60, 5)], 70, "5 channels"),
    "1-D": ([image[:, 0, 0]], 70, r"shape \(50,\)"),
    "empty": ([image[:0]], 70, r"shape \(0, 60, 3\)"),
    "NaN": ([np.full((50, 60, 3), np.nan)], 70, "non-finite"),
    "inf": ([np.full((50, 60, 3), np.inf)], 70, "non-finite"),
    "above 255": ([np.full((50, 60, 3), 300.0)], 70, "dtype float64"),
    "negative": ([np.full((50, 60, 3), -1.0)], 70, "dtype float64"),
}


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("case", ERRORS)
def test_errors_where_transformers_raises(case):
    images, budget, message = ERRORS[case]
    with pytest.raises((ValueError, ZeroDivisionError)):
        Gemma4ImageProcessorPil(max_soft_tokens=budget)(images, **LAST)
    with pytest.raises(ValueError, match=message):
        gi.preprocess(images, budget)


def test_errors_on_inputs_transformers_takes_differently():
    # transformers double-rescales floats in [0, 1], takes int64 and splits a 4-D array.
    with pytest.raises(ValueError, match="dtype float32"):
        gi.preprocess([np.full((50, 60, 3), 0.5, np.float32)])
    with pytest.raises(ValueError, match="dtype int64"):
        gi.preprocess([image.astype(np.int64)])
    with pytest.raises(ValueError, match=r"shape \(2, 50, 60, 3\)"):
        gi.preprocess([np.stack([image, image])])
    with pytest.raises(ValueError, match="one array of shape"):
        gi.preprocess(image)
    with pytest.raises(ValueError, match="patch_size=0"):
        gi.preprocess([image], patch_size=0)


# Video


@settings(max_examples=examples(60))
@given(
    st.tuples(st.integers(1, 200), st.integers(1, 200)),
    sizes.filter(lambda hw: hw != (1, 1)),
    st.integers(0, 2**32 - 1),
)
def test_video_resize_matches_torch_uint8_antialias(size_in, size_out, seed):
    # What torchvision's resize runs for uint8 BICUBIC on CPU; torch itself, no torchvision.
    # (torch 2.13 fails an internal assert resizing to 1×1, a size Gemma 4 never asks for.)
    frame = random_image(seed, *size_in, 3)
    t = torch.from_numpy(frame).permute(2, 0, 1)[None].contiguous()
    expected = torch.nn.functional.interpolate(
        t, size=list(size_out), mode="bicubic", align_corners=False, antialias=True
    )
    ours = gi._torch_resize_uint8(frame, size_out)
    np.testing.assert_array_equal(ours, expected[0].permute(1, 2, 0).numpy())


@settings(max_examples=examples(100))
@given(st.integers(1, 100), st.integers(1, 40), st.sampled_from([None, 1, 2.5]), st.booleans())
def test_frame_sampling_matches_transformers(total, num_frames, fps, by_fps):
    meta = VideoMetadata(total_num_frames=total, fps=None if fps is None else 10.0)
    n = None if by_fps else num_frames
    rate = fps if by_fps else None
    try:
        expected = default_sample_indices_fn(meta, num_frames=n, fps=rate)
    except ValueError:
        with pytest.raises(ValueError):
            gi.sample_frames(total, n, rate, meta.fps)
        return
    np.testing.assert_array_equal(gi.sample_frames(total, n, rate, meta.fps), expected)


def video_processor_class():
    try:
        from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor
    except Exception as e:  # torchvision missing, or broken beside this torch
        pytest.skip(f"Gemma4VideoProcessor needs a working torchvision: {e!r}")
    return Gemma4VideoProcessor


@settings(max_examples=examples(12))
@given(
    st.integers(1, 40),
    st.tuples(st.integers(1, 120), st.integers(1, 120)),
    st.sampled_from([70, 140, 280]),
    st.sampled_from([16, 4]),
    st.data(),
)
def test_video_matches_transformers(tokenizer, total, size, budget, patch_size, data):
    cls = video_processor_class()
    num_frames = data.draw(st.integers(1, total))
    frames = random_image(total, total * size[0], size[1], 3).reshape(total, *size, 3)
    video = cls(patch_size=patch_size, max_soft_tokens=budget, num_frames=num_frames)
    out = video(frames, return_metadata=True, **LAST)
    patches, grids, times = gi.preprocess_video(
        frames, budget, num_frames=num_frames, patch_size=patch_size
    )
    values, positions = out["pixel_values_videos"].numpy(), out["video_position_ids"].numpy()
    pairs = [hf_unpad(v, p) for v, p in zip(values, positions, strict=True)]
    assert_same((patches, grids), ([p for p, _ in pairs], [g for _, g in pairs]))
    indices = out["video_metadata"][0].frames_indices
    np.testing.assert_allclose(times, np.asarray(indices) / 24.0)

    prompt = "look at <|video|> ."
    text = make_processor(tokenizer, 70, 16, video)(text=[prompt], videos=[frames], **LAST)
    expanded = gp.expand_prompt(prompt, videos=[(times, gi.num_soft_tokens(grids)[0])])
    assert ids_of(tokenizer, expanded) == list(text["input_ids"][0])


def test_video_fps_sampling_matches_transformers():
    # Only a processor built with num_frames=None samples by fps (a per-call fps is ignored).
    frames = random_image(1, 40 * 30, 50, 3).reshape(40, 30, 50, 3)
    proc = video_processor_class()(num_frames=None)
    meta = {"total_num_frames": 40, "fps": 10.0}
    out = proc(frames, fps=2, video_metadata=meta, return_metadata=True, **LAST)
    patches, _, times = gi.preprocess_video(frames, num_frames=None, fps=2, video_fps=10.0)
    np.testing.assert_allclose(np.asarray(times) * 10.0, out["video_metadata"][0].frames_indices)
    assert len(patches) == len(out["pixel_values_videos"]) == 8


def test_video_defaults_and_errors():
    frames = random_image(0, 40 * 30, 50, 3).reshape(40, 30, 50, 3)
    patches, grids, times = gi.preprocess_video(frames)
    assert len(patches) == 32 and grids[0] == gi.preprocess([frames[0]], 70)[1][0]
    assert times[:6] == [0.0, 1 / 24, 2 / 24, 3 / 24, 5 / 24, 6 / 24]
    with pytest.raises(ValueError, match="num_frames=32"):
        gi.preprocess_video(frames[:8])
    with pytest.raises(ValueError, match="num_frames=32 and fps=2"):
        gi.preprocess_video(frames, fps=2)
    with pytest.raises(ValueError, match="video_fps"):
        gi.preprocess_video(frames, num_frames=None, fps=2)
    assert len(gi.preprocess_video(frames, num_frames=None, fps=2, video_fps=10)[0]) == 8
    with pytest.raises(ValueError, match=r"shape \(30, 50, 3\)"):
        gi.preprocess_video(frames[0])
    with pytest.raises(ValueError, match="dtype float32"):
        gi.preprocess_video(frames.astype(np.float32))


# Prompt


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


def make_processor(tokenizer, budget, patch_size, video=None):
    """Gemma4Processor; the given or a default video processor where torchvision imports."""
    if video is None:
        try:
            video = video_processor_class()(max_soft_tokens=70)
        except pytest.skip.Exception:
            pass
    return hf_processor(tokenizer, budget, patch_size, video)


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_placeholders_are_the_tokenizer_s(tokenizer):
    proc = make_processor(tokenizer, 70, 16)
    t = gp.GEMMA4_TOKENS
    assert (proc.image_token, proc.boi_token, proc.eoi_token, proc.video_token) == (
        t.image_token,
        t.boi_token,
        t.eoi_token,
        t.video_token,
    )


@settings(max_examples=examples(40))
@given(
    st.lists(st.tuples(st.integers(1, 200), st.integers(1, 200)), min_size=0, max_size=3),
    st.lists(st.sampled_from(WORDS), min_size=0, max_size=4),
    st.sampled_from(gi.BUDGETS),
    st.integers(0, 2**32 - 1),
)
def test_expanded_prompt_matches_transformers(tokenizer, sizes_, words, budget, seed):
    images = [random_image(seed + i, h, w, 3) for i, (h, w) in enumerate(sizes_)]
    gaps = [words[i] if i < len(words) else "" for i in range(len(images) + 1)]
    prompt = "<|image|>".join(gaps) + " ."
    proc = make_processor(tokenizer, budget, 4)
    out = proc(text=[prompt], images=[images] if images else None, **LAST)
    expected = list(out["input_ids"][0])

    soft = gi.num_soft_tokens(gi.preprocess(images, budget, patch_size=4)[1]) if images else []
    tokens = gp.PromptTokens(
        image_token_id=tokenizer.image_token_id,
        boi_token_id=tokenizer.convert_tokens_to_ids("<|image>"),
        eoi_token_id=tokenizer.convert_tokens_to_ids("<image|>"),
        video_token_id=proc.video_token_id,
    )
    assert ids_of(tokenizer, gp.expand_prompt(prompt, soft)) == expected
    assert gp.expand_prompt(ids_of(tokenizer, prompt), soft, tokens=tokens).tolist() == expected


@settings(max_examples=examples(40))
@given(
    st.integers(1, 3000),
    st.integers(1, 8),
    st.integers(1, 4),
    st.sampled_from([None, 7.5, 30.0]),
    st.lists(st.sampled_from(WORDS), min_size=0, max_size=3),
)
def test_video_prompt_matches_transformers(tokenizer, total, num_frames, n, fps, words):
    # Gemma4Processor's own replace_video_token and replacement pass on the frames we keep.
    proc = make_processor(tokenizer, 70, 16)
    index = gi.sample_frames(total, min(num_frames, total))
    meta = VideoMetadata(total_num_frames=total, fps=fps, frames_indices=list(index))
    replacement = proc.replace_video_token(
        {"num_soft_tokens_per_video": [n], "video_metadata": [meta]}, 0
    )
    prompt = " ".join(words) + " <|video|> ."
    expanded = proc.get_text_with_replacements([prompt], videos_replacements=[replacement])[0]
    times = [int(i) / (fps or 24.0) for i in index]
    assert gp.expand_prompt(prompt, videos=[(times, n)]) == expanded[0]

    tokens = gp.PromptTokens(
        image_token_id=tokenizer.image_token_id,
        boi_token_id=tokenizer.convert_tokens_to_ids("<|image>"),
        eoi_token_id=tokenizer.convert_tokens_to_ids("<image|>"),
        video_token_id=proc.video_token_id,
    )
    ours = gp.expand_prompt(
        ids_of(tokenizer, prompt),
        videos=[(times, n)],
        tokens=tokens,
        tokenize=lambda s: ids_of(tokenizer, s),
    )
    assert ours.tolist() == ids_of(tokenizer, expanded[0])


def test_timestamps_are_minutes_and_seconds_without_hours():
    assert [gp.timestamp(s) for s in (0, 59.99, 60, 3725.5)] == ["00:00", "00:59", "01:00", "62:05"]


def test_prompt_errors():
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        gp.expand_prompt("<|image|> <|image|>", [70])
    with pytest.raises(ValueError, match="0 video placeholders but 1 videos"):
        gp.expand_prompt("text", videos=[([0.0], 70)])
    with pytest.raises(ValueError, match="tokenize"):
        gp.expand_prompt([258_884], videos=[([0.0], 70)])
    with pytest.raises(ValueError, match=r"shape \(1, 2\)"):
        gp.expand_prompt(np.zeros((1, 2), np.int64), [])
