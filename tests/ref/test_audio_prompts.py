"""Prompts and generation with audio: the expanded ids against Gemma4Processor's, greedy tokens of
`Gemma4.generate_from` against transformers' `generate` with audio clips (and an image between
them), guards shown to fail on the defects they guard (an audio run given the bidirectional
vision mask; the audio token's own per-layer input instead of the pad token's), and refusals
naming the value.

Tolerance: the logits of the prompt's last token against transformers' forward, relative
error max|ours − HF| / max|HF| ≤ 1e-5 in float32; a guarded defect misses by more than 100×
that.
"""

import functools
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import ref.gemma4.text as text_module
from ref.gemma4 import Gemma4
from ref.gemma4.audio_features import MAX_SAMPLES, num_soft_tokens
from ref.gemma4.audio_tower import AudioTower
from ref.gemma4.images import num_soft_tokens as image_soft_tokens
from ref.gemma4.images import preprocess
from ref.gemma4.multimodal import prompt_inputs, soft_rows
from ref.gemma4.prompts import PromptTokens, expand_prompt
from tests.hf_processor import WORDS, greedy_with_gap, hf_processor, word_backend, word_tokenizer
from tests.hf_vision import tree_of
from tests.text_oracle import AUDIO, BOA, BOI, EOA, EOI, IMAGE, hf_audio_vlm
from tests.util import examples, prompt_logits, rel_err

NEW_TOKENS = 8
MARGIN = 1e-4  # float32 runs differ by ~1e-6: a smaller top-2 gap would be a coin toss
RTOL_F32 = 1e-5
CAUGHT = 100 * RTOL_F32
BUDGET, PATCH = 70, 2  # an image of ≤ 70 soft tokens, 2×2-pixel patches (the tiny tower's)
TOKENS = PromptTokens(
    image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI, video_token_id=7,
    audio_token_id=AUDIO, boa_token_id=BOA, eoa_token_id=EOA,
)  # fmt: skip


def tokenize(text):
    return word_backend().encode(text).ids


def noise(rng, n):
    return (0.3 * rng.standard_normal(n)).astype(np.float32)


def image(rng):
    return rng.integers(0, 256, (int(rng.integers(8, 40)), int(rng.integers(8, 40)), 3), np.uint8)


@functools.cache
def processor():
    return hf_processor(word_tokenizer(), BUDGET, PATCH)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, ours from its save_pretrained folder): a tiny Gemma 4 with a vision
    tower, an audio tower and embed_audio, bidirectional vision on its sliding layers."""
    hf = hf_audio_vlm()
    folder = tmp_path_factory.mktemp("audio-model")
    hf.save_pretrained(folder)
    ours = Gemma4.from_pretrained(folder)
    tower = AudioTower.from_pretrained(folder)
    assert ours.audio is not None and ours.config.audio_token_id == AUDIO
    assert ours.tokens == TOKENS
    assert tower.config == ours.audio.config
    return hf, ours


# --- prompts -----------------------------------------------------------------------------


@settings(max_examples=examples(10), deadline=None)
@given(
    kinds=st.lists(st.sampled_from(["audio", "image"]), min_size=1, max_size=4),
    samples=st.lists(
        st.one_of(st.integers(1, 20_000), st.sampled_from([160, 161, MAX_SAMPLES])),
        min_size=4,
        max_size=4,
    ),
    words=st.lists(st.sampled_from(WORDS), min_size=5, max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_ids_equal_the_processors(kinds, samples, words, seed):
    """Placeholders of clips (≤ 160 samples: no soft tokens, 30 s: 750) and images in any
    order: Gemma4Processor's ids, from text (`expand_prompt` then tokenize; `prompt_inputs`)
    and from ids (`expand_prompt` on the prompt's ids)."""
    rng = np.random.default_rng(seed)
    marks = {"audio": "<|audio|>", "image": "<|image|>"}
    prompt = " ".join(f"{words[i]} {marks[k]}" for i, k in enumerate(kinds)) + f" {words[-1]}"
    clips = [noise(rng, samples[i]) for i, k in enumerate(kinds) if k == "audio"]
    images = [image(rng) for k in kinds if k == "image"]
    out = processor()(
        text=[prompt],
        images=[images] if images else None,
        audio=clips or None,
        input_data_format="channels_last",
    )
    want = list(out["input_ids"][0])
    counts = [num_soft_tokens(len(c)) for c in clips]
    soft = image_soft_tokens(preprocess(images, BUDGET, patch_size=PATCH)[1]) if images else []
    text = expand_prompt(prompt, soft, audios=counts, tokens=TOKENS)
    assert tokenize(text) == want
    ids = expand_prompt(tokenize(prompt), soft, audios=counts, tokens=TOKENS)
    assert ids.tolist() == want
    sizes = dict(patch_size=PATCH, pooling_kernel_size=3, max_soft_tokens=BUDGET, tokens=TOKENS)
    got, _, grids, audios = prompt_inputs(prompt, images, (), clips, tokenize=tokenize, **sizes)
    assert got.tolist() == want and len(grids) == len(images)
    assert [len(a) for a in audios] == [len(c) for c in clips]


def test_soft_rows_keep_each_row_s_runs_in_order_of_appearance():
    """Two rows, image and audio runs interleaved differently, a clip of no soft tokens among
    them: each row's stream is its runs' soft tokens in its order, zero-padded to the longest."""
    rows = [
        [20, IMAGE, IMAGE, 20, AUDIO, 20, IMAGE],
        [AUDIO, AUDIO, AUDIO, 20, IMAGE, AUDIO, AUDIO],
    ]
    images = [np.full((n, 3), 10.0 + i) for i, n in enumerate([2, 1, 1])]
    audio = [np.full((n, 3), 20.0 + i) for i, n in enumerate([1, 3, 0, 2])]
    ids = dict(hidden=3, vision_ids=(IMAGE, 7), audio_ids=(AUDIO,))
    out = soft_rows(rows, images, audio, **ids)
    assert out[0, :, 0].tolist() == [10, 10, 20, 11, 0, 0]
    assert out[1, :, 0].tolist() == [21, 21, 21, 12, 23, 23]
    with pytest.raises(ValueError, match="2 audio clips given, the prompts hold 1 audio runs"):
        soft_rows(rows[:1], images[:2], audio[:2], **ids)


# --- generation ----------------------------------------------------------------------------

CASES = {
    "one clip": "look at <|audio|> then",
    "two clips, an image between": "look <|audio|> at <|image|> this <|audio|> then",
}


@pytest.mark.parametrize("case", CASES)
@settings(max_examples=examples(2), deadline=None)
@given(
    samples=st.lists(st.integers(400, 6_000), min_size=2, max_size=2, unique=True),
    chunk=st.sampled_from([None, 5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_greedy_tokens_equal_transformers(models, case, samples, chunk, seed):
    """`Gemma4.generate_from` on the text, the pixels and the samples against transformers'
    `generate` on Gemma4Processor's output; chunks of 5 cut the audio runs (causal: the
    running index carries on) and give the image a chunk of its own."""
    hf, ours = models
    rng = np.random.default_rng(seed)
    prompt = CASES[case]
    clips = [noise(rng, n) for n in samples[: prompt.count("<|audio|>")]]
    images = [image(rng) for _ in range(prompt.count("<|image|>"))]
    inputs = processor()(
        text=[prompt], images=[images] if images else None, audio=clips, return_tensors="pt"
    )
    want, gap = greedy_with_gap(hf, inputs, NEW_TOKENS)
    assume(gap > MARGIN)
    got = ours.generate_from(
        prompt,
        images,
        audios=clips,
        max_soft_tokens=BUDGET,
        tokenize=tokenize,
        max_new_tokens=NEW_TOKENS,
        chunk_size=chunk,
    )
    np.testing.assert_array_equal(got, want)


# --- guards: each defect makes the comparison with transformers fail -----------------------


@pytest.fixture(scope="module")
def guard(models):
    """Two clips (5 and 3 soft tokens, shorter than the 6-token sliding window) around an image,
    transformers' logits of the last prompt token, and ours (what each defect must break)."""
    hf, ours = models
    rng = np.random.default_rng(9)
    g = SimpleNamespace(prompt=CASES["two clips, an image between"])
    g.clips, g.images = [noise(rng, 3_000), noise(rng, 1_700)], [image(rng)]
    inputs = processor()(text=[g.prompt], images=[g.images], audio=g.clips, return_tensors="pt")
    with torch.no_grad():
        g.want = hf(**inputs).logits[0, -1].numpy()
    assert rel_err(last_logits(ours, g), g.want) <= RTOL_F32
    return g


def last_logits(ours, g):
    """Our logits [V] of the guard's prompt's last token (`prompt_logits`)."""
    return prompt_logits(ours, g.prompt, g.images, audios=g.clips, max_soft_tokens=BUDGET,
                         tokenize=tokenize)  # fmt: skip


def test_guard_a_bidirectional_audio_run_is_caught(models, guard, monkeypatch):
    """Audio runs opened as vision runs: on the sliding layers each audio token sees the clip's
    later tokens too (transformers' mm_token_type_ids mark audio 3, outside the vision block)."""
    placeholders = text_module.placeholder_masks

    def audio_as_vision(input_ids, config):
        placeholder, _ = placeholders(input_ids, config)
        return placeholder, placeholder

    monkeypatch.setattr(text_module, "placeholder_masks", audio_as_vision)
    assert rel_err(last_logits(models[1], guard), guard.want) > CAUGHT


def test_guard_the_audio_token_s_own_per_layer_input_is_caught(models, guard, monkeypatch):
    """Audio positions per-layer-embedded as the audio token, not the pad token (their token
    embedding is replaced by the soft tokens either way: only the per-layer input differs)."""
    monkeypatch.setattr(
        text_module,
        "embedding_ids",
        lambda ids, placeholder, pad: jnp.where(placeholder & (ids != AUDIO), pad, ids),
    )
    assert rel_err(last_logits(models[1], guard), guard.want) > CAUGHT


# --- refusals ------------------------------------------------------------------------------


def test_bad_audio_inputs_are_refused_naming_the_value(models):
    hf, ours = models
    run = functools.partial(
        ours.generate_from, tokenize=tokenize, max_new_tokens=1, max_soft_tokens=BUDGET
    )
    clip = np.zeros(1_000, np.float32)
    with pytest.raises(ValueError, match=r"audios\[0\] has 480001 samples \(30.00 s\)"):
        run("hear <|audio|>", audios=[np.zeros(MAX_SAMPLES + 1, np.float32)])
    with pytest.raises(ValueError, match=r"audios\[1\] has dtype int16"):
        run("hear <|audio|> <|audio|>", audios=[clip, np.zeros(9, np.int16)])
    with pytest.raises(ValueError, match="2 audio clip placeholders but 1 audio clips given"):
        run("hear <|audio|> and <|audio|>", audios=[clip])
    with pytest.raises(ValueError, match="0 audio clip placeholders but 1 audio clips given"):
        run("hear nothing", audios=[clip])
    ids = [BOA, *[AUDIO] * num_soft_tokens(len(clip)), EOA, 20]
    with pytest.raises(ValueError, match="2 audio clips given, the prompts hold 1 audio runs"):
        ours.generate(np.array([ids]), audios=[clip, clip], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"run at 1 has 2 tokens but its audio embeds to \(6,"):
        ours.generate(np.array([ids]), audios=[np.zeros(4_000, np.float32)], max_new_tokens=1)
    # a config without audio_config reads no audio tower (its weights are left unread)
    deaf = Gemma4.from_params(
        {**hf.config.to_dict(), "audio_config": None}, tree_of(hf.state_dict())
    )
    assert deaf.audio is None and deaf.vision is not None
    with pytest.raises(ValueError, match="1 audio clips given but the model has no audio tower"):
        deaf.generate_from("hear <|audio|>", audios=[clip], tokenize=tokenize, max_new_tokens=1)
