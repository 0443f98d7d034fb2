"""Gemma 4 12B Unified in `ref` against transformers: the processor's pixels and ids equal
Gemma4UnifiedProcessor's (images of drawn sizes, video, audio of drawn lengths), the embedders'
outputs equal Gemma4UnifiedModel's, greedy tokens of `Gemma4Unified.generate_from` equal
`Gemma4UnifiedForConditionalGeneration.generate` (text, images, video and audio mixed), each
guard shown to fail on its defect, and refusals naming the value.

Tolerances: pixels and ids exactly equal; embedder outputs relative error
max|ours − HF| / max|HF| ≤ 1e-5 in float32 (measured ~1e-6); a guarded defect misses by more
than 100× that. One tiny checkpoint (2 layers, hidden 32, vision width 24, 48-px blocks, a
position table of 64 rows per axis) serves every test.
"""

import functools

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ref.attention import dense
from ref.gemma4 import unified_config as U
from ref.gemma4.model import Gemma4
from ref.gemma4.multimodal import prompt_inputs
from ref.gemma4.prompts import PromptTokens
from ref.gemma4.unified import vision_apply
from ref.gemma4.unified_media import (
    BLOCKS,
    UNIFIED_MEDIA,
    audio_frames,
    grid_positions,
    num_audio_tokens,
    preprocess,
)
from ref.gemma4.unified_model import Gemma4Unified
from tests.hf_processor import WORDS, word_backend, word_tokenizer
from tests.hf_unified import (
    HF_INPUTS,
    VIDEO,
    ImageStandIn,
    VideoStandIn,
    hf_greedy,
    hf_unified,
    unified_processor,
)
from tests.hf_vision import tree_of
from tests.text_oracle import AUDIO, BOA, BOI, EOA, EOI, IMAGE
from tests.util import examples, prompt_logits, rel_err

RTOL = 1e-5
CAUGHT = 100 * RTOL
NEW_TOKENS = 6
MARGIN = 1e-4  # float32 runs differ by ~1e-6: a smaller top-2 gap would be a coin toss
FRAMES = 4  # frames kept of a video (the processor's 32 would make prompts of ~2,000 tokens)


def tokenize(text):
    return word_backend().encode(text).ids


def image(rng, low=20, high=260):
    return rng.integers(0, 256, (int(rng.integers(low, high)), int(rng.integers(low, high)), 3),
                        np.uint8)  # fmt: skip


def clip(rng, n):
    return (0.3 * rng.standard_normal(n)).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, ours from its save_pretrained folder)."""
    hf = hf_unified()
    folder = tmp_path_factory.mktemp("unified-model")
    hf.save_pretrained(folder)
    ours = Gemma4Unified.from_pretrained(folder)
    assert ours.vision is not None and ours.audio is not None
    assert ours.tokens.video_token_id == 7 and ours.tokens.eoa_token_id == EOA
    return hf, ours


@functools.cache
def processor(budget, fps=()):
    video = VideoStandIn(list(fps), num_frames=FRAMES) if fps else None
    return unified_processor(word_tokenizer(), budget, video)


def hf_image_features(hf, images, budget):
    """transformers' embedder on its processor's padded arrays, padding dropped, per image."""
    out = ImageStandIn(budget)([images])
    with torch.no_grad():
        feats = hf.model.get_image_features(out["pixel_values"], out["image_position_ids"])
    return out, [f.numpy() for f in feats.pooler_output]


# --- embedders ------------------------------------------------------------------------------


@settings(max_examples=examples(2), deadline=None)
@given(
    budget=st.sampled_from([70, 140]),
    count=st.integers(1, 3),
    samples=st.lists(st.integers(1, 5_000), min_size=1, max_size=3),
    seed=st.integers(0, 2**31 - 1),
)
def test_embedders_equal_transformers(models, budget, count, samples, seed):
    """Images of drawn sizes packed with no padding, and clips of drawn lengths: the blocks
    equal the processor's unpadded rows exactly, the soft tokens transformers' within RTOL."""
    hf, ours = models
    rng = np.random.default_rng(seed)
    images = [image(rng) for _ in range(count)]
    out, want = hf_image_features(hf, images, budget)
    patches, grids = preprocess(images, budget)
    for i, (p, (h, w)) in enumerate(zip(patches, grids, strict=True)):
        n = out["num_soft_tokens_per_image"][i]
        assert h * w == n
        np.testing.assert_array_equal(p, out["pixel_values"][i, :n].numpy())
        np.testing.assert_array_equal(grid_positions([(h, w)]), out["image_position_ids"][i, :n])
    got = ours.vision.embed(patches, grids)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= RTOL
    clips = [clip(rng, n) for n in samples]
    extracted = processor(budget).feature_extractor(clips, return_tensors="pt")
    with torch.no_grad():
        hf_audio = hf.model.get_audio_features(
            extracted["input_features"], extracted["input_features_mask"]
        ).pooler_output
    embeds, counts = ours.audio.encode_waveforms(clips)
    assert counts == [num_audio_tokens(n) for n in samples]
    cu = np.cumsum([0, *counts])
    for i, n in enumerate(counts):
        np.testing.assert_array_equal(
            audio_frames(clips[i]), extracted["input_features"][i, :n].numpy()
        )
        assert rel_err(embeds[cu[i] : cu[i + 1]], hf_audio[i, :n].numpy()) <= RTOL


# --- guards: each defect makes the comparison with transformers fail -----------------------


@pytest.fixture(scope="module")
def guard(models):
    """Two non-square images and a clip, transformers' soft tokens for them."""
    hf, _ = models
    rng = np.random.default_rng(11)
    images = [rng.integers(0, 256, s, np.uint8) for s in ((100, 200, 3), (150, 90, 3))]
    out, want = hf_image_features(hf, images, 70)
    samples = clip(rng, 3_000)
    extracted = processor(70).feature_extractor([samples], return_tensors="pt")
    with torch.no_grad():
        audio = (
            hf.model.get_audio_features(
                extracted["input_features"], extracted["input_features_mask"]
            )
            .pooler_output[0]
            .numpy()
        )
    return images, out, want, samples, audio


def embed(ours, patches, positions):
    return np.asarray(vision_apply(ours.vision.params, np.concatenate(patches), positions,
                                   config=ours.vision.config))  # fmt: skip


def test_guard_mean_std_applied_is_caught(models, guard):
    """ImageNet's per-channel mean and std applied to the pixels (a uniform one would pass
    through the first LayerNorm almost unseen: it is affine per token)."""
    _, ours = models
    images, _, want, _, _ = guard
    patches, grids = preprocess(images, 70)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    normed = [((p.reshape(-1, 3) - mean) / std).reshape(p.shape).astype(np.float32)
              for p in patches]  # fmt: skip
    got = embed(ours, normed, grid_positions(grids))
    assert rel_err(got[: len(want[0])], want[0]) > CAUGHT


def test_guard_x_and_y_swapped_is_caught(models, guard):
    _, ours = models
    images, _, want, _, _ = guard
    patches, grids = preprocess(images, 70)
    got = embed(ours, patches, grid_positions(grids)[:, ::-1])
    assert rel_err(got[: len(want[0])], want[0]) > CAUGHT
    assert rel_err(embed(ours, patches, grid_positions(grids))[: len(want[0])], want[0]) <= RTOL


def test_guard_padding_patches_kept_is_caught(models, guard):
    """The processor's padding rows kept in the stream (positions clamped to 0, as a packer
    that does not drop them would): the second image's run is filled from the first's
    padding."""
    _, ours = models
    _, out, want, _, _ = guard
    padded = [out["pixel_values"][i].numpy() for i in range(2)]
    positions = np.maximum(out["image_position_ids"].numpy().reshape(-1, 2), 0)
    got = embed(ours, padded, positions)
    n0, n1 = len(want[0]), len(want[1])
    assert rel_err(got[n0 : n0 + n1], want[1]) > CAUGHT


def test_guard_audio_frames_of_the_wrong_length_are_caught(models, guard):
    """Frames of 320 samples (zero-padded to the embedder's 640): twice the processor's soft
    tokens, and the first differs."""
    _, ours = models
    *_, samples, want = guard
    short = audio_frames(samples, 320)
    assert len(short) != len(want)
    frames = np.pad(short, ((0, 0), (0, 320)))
    got, _ = ours.audio.encode_waveforms([frames[0]])
    assert rel_err(got[0], want[0]) > CAUGHT


# --- the processor and generation ------------------------------------------------------------


@st.composite
def requests(draw):
    """(text, images, videos [(frames, fps)], clips, budget): an image, a video and a clip in a
    drawn order between words (some kinds twice), frames 48–120 px (a few blocks each)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    kinds = draw(st.lists(st.sampled_from(["image", "video", "audio"]), min_size=1, max_size=3))
    words = draw(st.lists(st.sampled_from(WORDS), min_size=len(kinds) + 1, max_size=len(kinds) + 1))
    marks = {"image": "<|image|>", "video": "<|video|>", "audio": "<|audio|>"}
    text = " ".join(f"{w} {marks[k]}" for w, k in zip(words, kinds, strict=False)) + f" {words[-1]}"
    images = [image(rng, 40, 200) for k in kinds if k == "image"]
    videos = []
    for _ in range(kinds.count("video")):
        size = rng.integers(48, 121, 2)
        frames = rng.integers(0, 256, (int(rng.integers(FRAMES, 3 * FRAMES)), *size, 3), np.uint8)
        videos.append((frames, draw(st.sampled_from([None, 10.0]))))
    clips = [clip(rng, int(rng.integers(1, 4_000))) for k in kinds if k == "audio"]
    return text, images, videos, clips, draw(st.sampled_from([70, 140]))


def hf_inputs(text, images, videos, clips, budget):
    out = processor(budget, tuple(fps for _, fps in videos))(
        text=text,
        images=[images] if images else None,
        videos=[f for f, _ in videos] or None,
        audio=clips or None,
        return_tensors="pt",
    )
    return {k: out[k] for k in HF_INPUTS if k in out}


TOKENS = PromptTokens(
    image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI, video_token_id=VIDEO,
    audio_token_id=AUDIO, boa_token_id=BOA, eoa_token_id=EOA,
)  # fmt: skip


def our_inputs(text, images, videos, clips, budget):
    return prompt_inputs(
        text, images, videos, clips, **BLOCKS, media=UNIFIED_MEDIA, tokenize=tokenize,
        max_soft_tokens=budget, tokens=TOKENS, num_frames=FRAMES,
    )  # fmt: skip


@settings(max_examples=examples(4), deadline=None)
@given(requests())
def test_ids_and_pixels_equal_the_processors(request):
    """Gemma4UnifiedProcessor's ids, and its pixel arrays without their padding rows: images
    first, then video frames, each in order (ours hold them in order of appearance)."""
    want = hf_inputs(*request)
    ids, patches, grids, audios = our_inputs(*request)
    assert ids.tolist() == want["input_ids"][0].tolist()
    kinds = [
        int(ids[a]) for a in np.flatnonzero(np.diff(np.isin(ids, (IMAGE, VIDEO)), prepend=0) == 1)
    ]
    ours = {IMAGE: [], VIDEO: []}
    for kind, p in zip(kinds, patches, strict=True):
        ours[kind].append(p)
    for kind, key in ((IMAGE, "pixel_values"), (VIDEO, "pixel_values_videos")):
        rows = want.get(key, torch.zeros(0))
        positions = want.get("image_position_ids" if kind == IMAGE else "video_position_ids")
        assert len(ours[kind]) == len(rows)
        for p, row, pos in zip(
            ours[kind], rows, positions if positions is not None else [], strict=True
        ):
            n = int((pos[:, 0] >= 0).sum())
            np.testing.assert_array_equal(p, row[:n].numpy())
    assert [len(a) for a in audios] == [len(c) for c in request[3]]


@settings(max_examples=examples(2), deadline=None)
@given(requests(), st.sampled_from([None, 16]))
def test_greedy_tokens_equal_transformers(models, request, chunk):
    """`Gemma4Unified.generate_from` on the text, pixels and samples against transformers'
    `generate` (static cache: see `hf_greedy`) on Gemma4UnifiedProcessor's output; chunks of
    16 keep each image and frame whole and may cut an audio run."""
    hf, ours = models
    want, gap = hf_greedy(hf, hf_inputs(*request), NEW_TOKENS)
    assume(gap > MARGIN)
    text, images, videos, clips, budget = request
    got = ours.generate_from(
        text, images, videos=videos, audios=clips, max_soft_tokens=budget, tokenize=tokenize,
        max_new_tokens=NEW_TOKENS, chunk_size=chunk, num_frames=FRAMES,
    )  # fmt: skip
    np.testing.assert_array_equal(got, want)


# --- refusals --------------------------------------------------------------------------------


def test_bad_configs_and_inputs_are_refused_naming_the_value(models):
    hf, ours = models
    config = hf.config.to_dict()
    with pytest.raises(ValueError, match="model_type='gemma4': expected 'gemma4_unified'"):
        U.text_config({**config, "model_type": "gemma4"})
    bad = {**config, "text_config": {**config["text_config"], "enable_moe_block": True}}
    with pytest.raises(ValueError, match="enable_moe_block=True: Gemma 4 12B Unified has no"):
        U.text_config(bad)
    vision = {**config["vision_config"], "output_proj_dims": 7}
    with pytest.raises(ValueError, match="output_proj_dims=7"):
        U.vision_config({**config, "vision_config": vision})
    with pytest.raises(ValueError, match=r"image 0 has shape \(9, 9, 4\) \(RGBA\)"):
        preprocess([np.zeros((9, 9, 4), np.uint8)])
    with pytest.raises(ValueError, match="max_soft_tokens=100: expected one of"):
        preprocess([np.zeros((9, 9, 3), np.uint8)], 100)
    with pytest.raises(ValueError, match=r"audios\[0\] has shape \(0,\)"):
        ours.generate_from("<|audio|>", audios=[np.zeros(0)], tokenize=tokenize, max_new_tokens=1)
    with pytest.raises(ValueError, match="past the position table's 64 rows"):
        ours.vision.embed([np.zeros((65, 6912), np.float32)], [(1, 65)])
    with pytest.raises(
        ValueError, match="gemma4_unified.: load it with unified_model.Gemma4Unified"
    ):
        Gemma4.from_params(config, {})
    # transformers' in-memory names (model.embed_vision.patch_ln1, …), not the checkpoint's
    with pytest.raises(ValueError, match=r"vision part but the checkpoint lacks one of model"):
        Gemma4Unified.from_params(config, tree_of(hf.state_dict()))


def last_logits(ours, text, images):
    """Our logits [V] of the prompt's last token (`prompt_logits`)."""
    return prompt_logits(ours, text, images, max_soft_tokens=70, tokenize=tokenize)


def test_guard_vision_blocks_open_past_the_window_is_caught(models, monkeypatch):
    """An image's tokens seeing each other past the sliding window, OR(AND(causal, window),
    same run) as transformers' default dynamic-cache path masks (see `hf_greedy`), differs
    from its static-cache generate, AND(window, OR(causal, same run)). (Its other difference,
    the block open on full layers, cannot show in this 2-layer model: the full layer is the
    last, and the last token's logits read no image token's output there.)"""
    hf, ours = models
    rng = np.random.default_rng(12)
    text, images = "look <|image|> this", [rng.integers(0, 256, (48, 96, 3), np.uint8)]
    inputs = hf_inputs(text, images, [], [], 70)
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0,
                          cache_implementation="static", output_logits=True,
                          return_dict_in_generate=True)  # fmt: skip
    want = out.logits[0][0].numpy()
    assert rel_err(last_logits(ours, text, images), want) <= RTOL

    def window_first(q_side, kv_side, sliding_window):
        qp, qg, q_valid, q_run = q_side
        kp, kg, kv_valid, _ = kv_side
        visible = kp <= qp
        if sliding_window is not None:
            visible = visible & (qp - kp < sliding_window)
        if qg is not None:
            visible = visible | ((qg == kg) & q_run)
        return visible & q_valid & kv_valid

    monkeypatch.setattr(dense, "_visible", window_first)
    assert rel_err(last_logits(ours, text, images), want) > CAUGHT
