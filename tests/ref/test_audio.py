"""The audio path: features, soft-token counts and the packed tower against transformers, packing
invariance, the chunked attention against its dense reference, and guards shown to fail on the
defects they guard.

Tolerances: features |ours − transformers| ≤ 1e-6 absolute (float32 resolution at the log-mel
values' size, |x| < 16: ≤ 9.5e-7; measured 0, bit for bit); the tower and embed_audio against
Gemma4AudioModel / Gemma4MultimodalEmbedder in float32, relative error max|ours − HF| / max|HF|
≤ 1e-5 per clip and per layer; in float64, packed clips against each clip alone and the
chunked attention against the dense reference ≤ 1e-12.
"""

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

import ref.gemma4.audio as audio_module
import ref.gemma4.audio_attention as attention_module
import ref.gemma4.audio_features as features_module
from ref.gemma4.audio_attention import chunked_attention
from ref.gemma4.audio_config import AudioConfig
from ref.gemma4.audio_features import MAX_SAMPLES, log_mel, num_soft_tokens
from ref.gemma4.audio_packing import chunk_index, pack, soft_tokens
from ref.gemma4.audio_reference import reference
from ref.gemma4.audio_tower import AudioTower, audio_apply, audio_forward
from tests.hf_audio import (
    hf_audio_config,
    hf_audio_embedder,
    hf_audio_model,
    hf_encode,
    hf_features,
)
from tests.hf_vision import tree_of
from tests.strategies import audio_configs, clip_samples
from tests.util import examples, jitted, rel_err

FEATURES_ATOL = 1e-6
RTOL_F32 = 1e-5
CAUGHT = 100 * RTOL_F32  # a guarded defect must miss transformers by more than this


def waveform(rng, n, kind):
    """n float32 samples: noise, silence, noise clipped at ±1, a loud tone or a quiet hiss."""
    if kind == "silence":
        return np.zeros(n, np.float32)
    if kind == "clipped":
        return np.clip(3 * rng.standard_normal(n), -1, 1).astype(np.float32)
    if kind == "tone":
        return (0.9 * np.sin(2 * np.pi * 440 / 16_000 * np.arange(n))).astype(np.float32)
    scale = 1e-4 if kind == "hiss" else 0.3
    return (scale * rng.standard_normal(n)).astype(np.float32)


KINDS = st.sampled_from(["noise", "silence", "clipped", "tone", "hiss"])


# --- features and counts -------------------------------------------------------------------


@settings(max_examples=examples(8))
@given(
    clips=st.lists(
        st.tuples(st.one_of(clip_samples(), st.sampled_from([479_999, MAX_SAMPLES])), KINDS),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 99),
)
def test_features_equal_the_feature_extractor(clips, seed):
    """Each clip's log-mel frames and mask against Gemma4AudioFeatureExtractor on the batch
    (padded to the longest clip: a clip's own frames first, then invalid zeros)."""
    rng = np.random.default_rng(seed)
    waves = [waveform(rng, n, kind) for n, kind in clips]
    theirs, their_masks = hf_features(waves)
    for w, want, want_mask in zip(waves, theirs, their_masks, strict=True):
        got, mask = log_mel(w)
        t = len(got)
        assert got.dtype == np.float32 and got.shape[1] == 128
        np.testing.assert_array_equal(mask, want_mask[:t])
        assert not want_mask[t:].any() and not want[t:].any()
        assert np.abs(got - want[:t]).max(initial=0.0) <= FEATURES_ATOL
        assert int(mask.sum()) == -(-(len(w) - 160) // 160)


def processor_counts(n, mask):
    """The processor's two counts: from the sample count (`_compute_audio_num_tokens`) and from
    the feature mask (`replace_audio_token`, what Gemma4Processor.__call__ inserts)."""
    proc = SimpleNamespace(feature_extractor=Gemma4AudioFeatureExtractor(), audio_seq_length=750)
    by_length = Gemma4Processor._compute_audio_num_tokens(proc, np.zeros(n), 16_000)
    marks = SimpleNamespace(boa_token="[", audio_token="a", eoa_token="]")
    text = Gemma4Processor.replace_audio_token(marks, {"input_features_mask": [mask]}, 0)
    return by_length, text.count("a")


@settings(max_examples=examples(30))
@given(n=st.one_of(st.integers(34, MAX_SAMPLES), st.sampled_from([160, 161, MAX_SAMPLES])))
def test_soft_token_count_is_the_processors(n):
    _, mask = log_mel(np.zeros(n, np.float32))
    by_length, by_mask = processor_counts(n, mask)
    assert num_soft_tokens(n) == by_length == by_mask == soft_tokens(int(mask.sum()))
    assert num_soft_tokens(n) <= 750


def test_thirty_seconds_give_750_tokens_and_a_short_clip_none():
    assert num_soft_tokens(MAX_SAMPLES) == 750
    assert num_soft_tokens(160) == 0 and num_soft_tokens(161) == 1
    features, mask = log_mel(np.zeros(100, np.float32))
    assert features.shape == (0, 128) and mask.shape == (0,)


# --- the tower against transformers --------------------------------------------------------


def tower_and_oracles(cfg, seed):
    """(Gemma4AudioModel, Gemma4MultimodalEmbedder, our AudioTower with their weights)."""
    model, embedder = hf_audio_model(cfg, seed), hf_audio_embedder(cfg, seed + 1)
    tower = AudioTower(cfg, tree_of(model.state_dict()), tree_of(embedder.state_dict()))
    return model, embedder, tower


@settings(max_examples=examples(6))
@given(
    cfg=audio_configs(),
    lengths=st.lists(clip_samples(), min_size=1, max_size=3),
    seed=st.integers(0, 99),
)
def test_tower_matches_transformers_per_clip_per_layer_and_embedded(cfg, lengths, seed):
    """Clips packed in one call, from their samples (our features) against transformers from
    the same samples (its feature extractor, one clip a call): soft tokens, embed_audio, and the
    input of every layer (HF's hidden_states: the subsampled frames, layer outputs 1 … L−1)."""
    model, embedder, tower = tower_and_oracles(cfg, seed)
    rng = np.random.default_rng(seed)
    waves = [waveform(rng, n, "noise") for n in lengths]
    pairs = [log_mel(w) for w in waves]
    packing, out = tower.run([f for f, _ in pairs], [m for _, m in pairs], embed=True)
    ours_states = [out["subsampled"], *out["hidden_states"][:-1]]
    cu = packing.cu_tokens
    for i, w in enumerate(waves):
        features, mask = (a[0] for a in hf_features([w]))
        theirs, their_states = hf_encode(model, features, mask)
        theirs_embedded, _ = hf_encode(model, features, mask, embedder)
        rows = slice(cu[i], cu[i + 1])
        assert packing.token_counts[i] == len(theirs) == num_soft_tokens(len(w))
        assert rel_err(out["tokens"][rows], theirs) <= RTOL_F32
        assert rel_err(out["embeds"][rows], theirs_embedded) <= RTOL_F32
        assert len(their_states) == cfg.num_hidden_layers + 1
        for ours, want in zip(ours_states, their_states, strict=False):
            assert rel_err(np.asarray(ours)[rows], want) <= RTOL_F32


@settings(max_examples=examples(3))
@given(
    cfg=audio_configs(max_layers=1),
    lengths=st.lists(st.one_of(clip_samples(6_000), st.just(100)), min_size=2, max_size=4),
    extra=st.integers(0, 40),
    more=st.integers(0, 2),
    seed=st.integers(0, 99),
)
def test_packed_clips_equal_each_clip_alone_and_under_a_frame_budget(
    cfg, lengths, extra, more, seed
):
    """A clip's soft tokens do not depend on the clips beside it, nor on the frame budget
    (filler frames, rows, tokens and chunks), in float64 (in float32 the programs of different
    shapes round differently: 1.2e-6 seen); a clip of no valid frame gives none."""
    model = hf_audio_model(cfg, seed)
    tower = AudioTower(cfg, tree_of(model.state_dict()), dtype=np.float64)
    rng = np.random.default_rng(seed)
    pairs = [log_mel(waveform(rng, n, "noise")) for n in lengths]
    features, masks = [f for f, _ in pairs], [m for _, m in pairs]
    assume(any(m.any() for m in masks))
    together, counts = tower.encode(features, masks)
    budget = sum(int(m.sum()) for m in masks) + extra
    budgeted, budget_counts = tower.encode(
        features, masks, frame_budget=budget, max_clips=len(lengths) + more
    )
    assert counts == budget_counts and len(together) == sum(counts)
    cu = np.cumsum([0, *counts])
    for i, (f, m) in enumerate(pairs):
        alone, (count,) = tower.encode([f], [m])
        assert count == counts[i] == soft_tokens(int(m.sum()))
        if count:
            assert rel_err(together[cu[i] : cu[i + 1]], alone) <= 1e-12
            assert rel_err(budgeted[cu[i] : cu[i + 1]], alone) <= 1e-12


# --- the chunked attention against its dense reference ---------------------------------------


@settings(max_examples=examples(12))
@given(
    chunking=st.tuples(st.integers(1, 12), st.integers(2, 14), st.integers(0, 3)),
    frames=st.lists(st.integers(0, 160), min_size=1, max_size=4),
    heads=st.integers(1, 3),
    extra=st.integers(0, 30),
    seed=st.integers(0, 99),
)
def test_chunked_attention_equals_the_dense_reference_in_float64(
    chunking, frames, heads, extra, seed
):
    """Packed clips, filler included (a frame budget): every real query's output equals the
    dense reference's, logits large enough that the soft cap bites."""
    assume(sum(frames) > 0)
    chunk, left, right = chunking
    cfg = AudioConfig(
        hidden_size=4 * heads,
        num_attention_heads=heads,
        attention_chunk_size=chunk,
        attention_context_left=left,
        attention_context_right=right,
    )
    packing = pack(frames, cfg, frame_budget=sum(frames) + extra, max_clips=len(frames) + 1)
    m, npos = len(packing.segment_ids), cfg.context_size // 2 + 1
    rng = np.random.default_rng(seed)
    q, k, v = (3 * rng.standard_normal((m, heads, 4)) for _ in range(3))
    rel_k = rng.standard_normal((npos, heads, 4))
    a = packing.arrays
    opts = dict(past=cfg.max_past, future=right, cap=5.0, invalid=-1e9)
    got = jitted(
        chunked_attention,
        q,
        k,
        v,
        rel_k,
        a["chunk_queries"],
        a["chunk_keys"],
        a["token_slots"],
        **opts,
    )
    want = jitted(reference, q, k, v, rel_k, packing.segment_ids, **opts)
    real = packing.segment_ids >= 0
    assert got.dtype == np.float64
    assert rel_err(np.asarray(got)[real], np.asarray(want)[real]) <= 1e-12


def test_released_window_is_the_frame_and_its_11_past_frames():
    """The released chunking (12 queries, 12 past keys, none ahead): wherever a query sits in
    its chunk, it sees itself and 11 past frames (so chunk boundaries never change its keys)."""
    visible = attention_module.window(12, 12, 0)
    for i in range(12):
        slots = np.flatnonzero(visible[i])
        assert list(slots - 12 - i) == list(range(-11, 1))


# --- guards: each defect makes the comparison with transformers fail -----------------------

GUARD = AudioConfig(
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=(128, 4),
    attention_logit_cap=5.0,
    output_proj_dims=12,
    text_hidden_size=20,
)


@pytest.fixture(scope="module")
def guard():
    """Two clips (7 and 10 soft tokens) through a one-layer tower, transformers' tokens per clip,
    and a run that matches them (what each defect must break)."""
    model, _, tower = tower_and_oracles(GUARD, 5)
    rng = np.random.default_rng(5)
    pairs = [log_mel(waveform(rng, n, "noise")) for n in (4_000, 6_000)]
    features, masks = [f for f, _ in pairs], [m for _, m in pairs]
    expected = [hf_encode(model, f, m)[0] for f, m in pairs]
    packing, frames = tower.pack(features, masks)
    g = SimpleNamespace(model=model, tower=tower, packing=packing, frames=frames)
    g.features, g.masks, g.expected = features, masks, expected
    assert worst(g, run(g)) <= RTOL_F32
    return g


def run(g, arrays=None, params=None, fresh=False):
    """Packed tokens [M, out] of the guard clips; `fresh` traces anew (a patched function: the
    cached trace of `audio_forward` would not see it)."""
    forward = functools.partial(audio_forward, config=GUARD)
    if fresh:
        forward = jax.jit(functools.partial(audio_apply, config=GUARD, keep_states=False))
    args = (params or g.tower.params, None, g.frames, arrays or g.packing.arrays)
    return np.asarray(forward(*args)["tokens"])


def worst(g, tokens):
    """The largest per-clip relative error of packed tokens against transformers."""
    cu = g.packing.cu_tokens
    return max(rel_err(tokens[cu[i] : cu[i + 1]], want) for i, want in enumerate(g.expected))


def test_guard_a_chunk_crossing_clips_is_caught(guard):
    """Chunks cut over the packed sequence as one clip: the second clip's first queries see the
    first clip's last frames."""
    tokens = guard.packing.num_real_tokens
    c = GUARD.attention_chunk_size
    queries, keys, slots = chunk_index(
        (tokens,), c, GUARD.max_past, GUARD.attention_context_right, -(-tokens // c), tokens
    )
    crossing = {**guard.packing.arrays, "chunk_queries": queries}
    crossing |= {"chunk_keys": keys, "token_slots": slots}
    assert worst(guard, run(guard, crossing)) > CAUGHT


def test_guard_reversed_relative_positions_are_caught(guard, monkeypatch):
    """The relative table's rows in ascending position order (position d at row d)."""
    table = audio_module.relative_embeddings
    monkeypatch.setattr(audio_module, "relative_embeddings", lambda c, dt: table(c, dt)[::-1])
    assert worst(guard, run(guard, fresh=True)) > CAUGHT


def test_guard_softcap_after_the_mask_is_caught(guard, monkeypatch):
    """Masked logits capped to −cap instead of −1e9. At the released cap of 50 that is invisible
    with random weights (a weight e^−50 against visible logits near 0), so q and k are clamped
    to constants of opposite sign (their clip bounds): every visible logit saturates at −cap,
    and the defect gives the hidden keys the same weight."""
    state = {k: v.clone() for k, v in guard.model.state_dict().items()}
    for name, value in (("q_proj", 4.0), ("k_proj", -4.0)):
        for bound in ("output_min", "output_max"):
            state[f"layers.0.self_attn.{name}.{bound}"].fill_(value)
    model = hf_audio_model(GUARD, 5)
    model.load_state_dict(state)
    params = AudioTower(GUARD, tree_of(model.state_dict())).params
    saturated = SimpleNamespace(**vars(guard))
    saturated.expected = [
        hf_encode(model, f, m)[0] for f, m in zip(guard.features, guard.masks, strict=True)
    ]
    assert worst(saturated, run(saturated, params=params)) <= RTOL_F32

    def cap_after_mask(scores, visible, cap, invalid):
        masked = jnp.where(visible, scores, jnp.asarray(invalid, scores.dtype))
        return jnp.tanh(masked / cap) * cap

    monkeypatch.setattr(attention_module, "capped_masked_logits", cap_after_mask)
    assert worst(saturated, run(saturated, params=params, fresh=True)) > CAUGHT


def test_guard_causal_conv_padded_on_the_wrong_side_is_caught(guard):
    """The depthwise conv padded on the right: token t reads t … t + K − 1 of its clip."""
    taps = guard.packing.arrays["causal_taps"].copy()
    m, kernel = taps.shape
    for start, n in zip(guard.packing.cu_tokens[:-1], guard.packing.token_counts, strict=True):
        t = np.arange(n)[:, None] + np.arange(kernel)
        taps[start : start + n] = np.where(t < n, start + t, m)
    ahead = {**guard.packing.arrays, "causal_taps": taps}
    assert worst(guard, run(guard, ahead)) > CAUGHT


def test_guard_invalid_frames_not_zeroed_are_caught(monkeypatch):
    """Every frame called valid: the frames past the clip's last whole window keep their
    log-mel values, transformers' are zeros."""
    w = waveform(np.random.default_rng(0), 1_030, "noise")  # 7 frames, the last one invalid
    (want,), _ = hf_features([w])
    assert np.abs(log_mel(w)[0] - want).max() <= FEATURES_ATOL
    monkeypatch.setattr(features_module, "valid_frames", lambda n, t: np.ones(t, bool))
    assert np.abs(log_mel(w)[0] - want).max() > 1.0


# --- configs and refusals ------------------------------------------------------------------


def test_config_round_trips_through_transformers_and_a_full_checkpoint():
    from transformers import Gemma4Config

    cfg = AudioConfig(
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        subsampling_conv_channels=(128, 8),
        attention_context_right=2,
        gradient_clipping=3.0,
        output_proj_dims=12,
        text_hidden_size=20,
    )
    text = {"hidden_size": 20, "num_hidden_layers": 1, "num_attention_heads": 2}
    full = Gemma4Config(text_config=text, audio_config=hf_audio_config(cfg).to_dict()).to_dict()
    assert AudioConfig.from_hf(full) == cfg
    assert AudioConfig.from_hf(hf_audio_config(cfg).to_dict()) == dataclasses.replace(
        cfg, text_hidden_size=None
    )
    assert AudioConfig.from_hf({"model_type": "gemma4_audio"}) == AudioConfig()
    model, embedder = hf_audio_model(cfg, 1), hf_audio_embedder(cfg, 2)
    checkpoint = {f"model.audio_tower.{n}": t for n, t in model.state_dict().items()}
    checkpoint |= {f"model.embed_audio.{n}": t for n, t in embedder.state_dict().items()}
    tower = AudioTower.from_params(full, tree_of(checkpoint))
    w = waveform(np.random.default_rng(3), 5_000, "noise")
    embeds, counts = tower.encode_waveforms([w], embed=True)
    features, mask = (a[0] for a in hf_features([w]))
    assert counts == (num_soft_tokens(5_000),)
    assert rel_err(embeds, hf_encode(model, features, mask, embedder)[0]) <= RTOL_F32


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        (np.zeros(0, np.float32), "waveform is empty"),
        (np.zeros((2, 400), np.float32), r"shape \(2, 400\): expected one channel"),
        (np.array([0.0, np.nan, 0.0]), r"waveform\[1\] = nan: expected finite"),
        (np.array([0.0, 0.0, -np.inf]), r"waveform\[2\] = -inf"),
        (np.zeros(MAX_SAMPLES + 1, np.float32), "480001 samples .30.00 s.: the limit is 480000"),
        (np.zeros(400, np.int16), "dtype int16: expected float samples"),
    ],
)
def test_bad_waveforms_are_refused_naming_the_value(samples, message):
    with pytest.raises(ValueError, match=message):
        log_mel(samples)


def test_bad_tower_input_is_refused_naming_the_value():
    cfg = dataclasses.replace(GUARD, text_hidden_size=None)
    tower = AudioTower(cfg, tree_of(hf_audio_model(cfg, 0).state_dict()))
    f = np.zeros((6, 128), np.float32)
    mask = np.array([True, True, False, True, False, False])
    cases = [
        (lambda: tower.encode([]), "empty input"),
        (lambda: tower.encode([f[:, :64]]), r"features\[0\] has shape \(6, 64\)"),
        (lambda: tower.encode([f], [mask]), r"masks\[0\] is not a prefix .* \(frame 2 invalid"),
        (lambda: tower.encode([f], [mask.astype(int)]), r"masks\[0\] has shape \(6,\) and dtype"),
        (lambda: tower.encode([f], frame_budget=5), "frame_budget=5 is smaller than the 6"),
        (lambda: tower.encode([f, f], frame_budget=20, max_clips=1), "max_clips=1: fewer than"),
        (lambda: tower.embed([f]), "embed_audio weights"),
        (lambda: tower.encode_waveforms([np.zeros(3), np.ones(2)[None]]), r"waveforms\[1\]"),
        (lambda: num_soft_tokens(0), "num_samples=0: expected 1 to 480000"),
        (lambda: AudioConfig(attention_context_left=1), "attention_context_left=1"),
        (lambda: AudioConfig(subsampling_conv_channels=(64, 32)), r"channels=\(64, 32\)"),
        (lambda: AudioConfig(hidden_size=30), "num_attention_heads=8"),
        (lambda: AudioConfig(output_proj_dims=0), "output_proj_dims=0"),
        (lambda: AudioConfig.from_hf({"model_type": "gemma4", "audio_config": None}), "no audio"),
        (lambda: AudioConfig.from_hf({"hidden_act": "gelu"}), "hidden_act='gelu'"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
