"""Greedy generation end to end (packed vision tower → chunked prefill → decode) against
transformers' Gemma4ForConditionalGeneration.generate, token for token, over chunk sizes,
blocking modes per phase, batch 1 and 3 (different prompts), dense and MoE."""

import functools

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from ref.gemma4.model import Gemma4
from tests.hf_vision import patches_for, randomize_, tree_of
from tests.text_oracle import (
    FIRST_TEXT,
    hf_generate,
    hf_model,
    padded_rows,
    prompt,
    text_config,
)
from tests.util import examples

NEW_TOKENS = 16
MARGIN = 1e-4  # float32 runs differ by ~1e-6: a smaller top-2 gap would be a coin toss
GRIDS = [(3, 3), (3, 6), (6, 3), (6, 6)]
LAYERS = {
    False: ["sliding_attention", "sliding_attention", "full_attention"],
    True: ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}
_MODELS = {}


def _models(moe):
    """(transformers model, ours) for the dense (k_eq_v, PLE) or MoE (KV sharing) config."""
    if moe not in _MODELS:
        text = text_config(
            moe=moe,
            layer_types=LAYERS[moe],
            shared=2 if moe else 0,
            k_eq_v=not moe,
            ple=8,
            window=5,
        )
        hf = hf_model(text, seed=11 if moe else 7)
        _MODELS[moe] = hf, Gemma4.from_params(hf.config.to_dict(), tree_of(hf.state_dict()))
    return _MODELS[moe]


@st.composite
def batches(draw, batch):
    """Prompts of different lengths, 0–2 images each (row 0 always has one)."""
    rows = []
    for i in range(batch):
        grids = draw(st.lists(st.sampled_from(GRIDS), min_size=int(i == 0), max_size=2))
        rows.append((draw(st.integers(3, 24)), grids))
    return rows, draw(st.integers(0, 2**31 - 1))


# Chunk sizes 1, 7 and 32, every prefill mode, decode modes with kv, head and batch blocks
# (a decode step has one query, so its q blocks are one: qkv decodes as kv, hqkv as hkv), batch
# 1 and 3, dense and MoE, linear and ring sliding caches — one generation each. Unchunked
# generation with dense attention: test_from_pretrained (dense model) and the stop test's row
# alone (MoE), both batch 1. (moe, batch, chunk, prefill, decode, sliding layers in a ring)
CASES = [
    (False, 3, 7, "q", "kv", True),
    (False, 1, 1, "kv", "hqkv", False),
    (True, 3, 1, "online", "bhqkv", True),
    (True, 3, 32, "qkv", "hkv", False),
]


@pytest.mark.parametrize("moe, batch, chunk, prefill, decode, ring", CASES)
@settings(max_examples=examples(1))
@given(data=st.data())
def test_greedy_tokens_equal_transformers(moe, batch, chunk, prefill, decode, ring, data):
    hf, ours = _models(moe)
    rows, seed = data.draw(batches(batch))
    rng = np.random.default_rng(seed)
    ids, patches, grids, want = [], [], [], []
    for length, row_grids in rows:
        row_patches = patches_for(row_grids, rng, 12)
        row = prompt(rng, length, [h * w // 9 for h, w in row_grids], 96)
        tokens, logits = hf_generate(hf, row, row_patches, row_grids, NEW_TOKENS)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assume((top2[:, 1] - top2[:, 0]).min() > MARGIN)
        ids.append(row)
        patches += row_patches
        grids += row_grids
        want.append(tokens)
    lengths = [len(r) for r in ids]
    padded = np.zeros((batch, max(lengths)), np.int64)
    for i, row in enumerate(ids):
        padded[i, : len(row)] = row
    got = ours.generate(
        padded,
        patches,
        grids,
        max_new_tokens=NEW_TOKENS,
        chunk_size=chunk,
        prefill_blocking=prefill,
        decode_blocking=decode,
        lengths=lengths,
        sliding_ring=ring,
    )
    np.testing.assert_array_equal(got, padded_rows(want))


def test_generate_rejects_mismatched_images():
    hf, ours = _models(False)
    rng = np.random.default_rng(0)
    ids = prompt(rng, 5, [2], 96)[None]
    with pytest.raises(ValueError, match="1 images given, the prompts hold 0"):
        ours.generate_embedded(ids[:, :3] * 0 + 9, [np.zeros((2, 32))], max_new_tokens=2)
    with pytest.raises(ValueError, match="has 2 tokens but its image embeds to"):
        ours.generate_embedded(ids, [np.zeros((3, 32))], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ours.generate_embedded(ids, [np.zeros((2, 32))], max_new_tokens=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ours.generate_embedded(ids, [np.zeros((2, 32))], max_new_tokens=2, chunk_size=0)
    with pytest.raises(ValueError, match="lengths"):
        ours.generate_embedded(ids, [np.zeros((2, 32))], max_new_tokens=2, lengths=[99])


def test_from_pretrained_reads_a_saved_transformers_model(tmp_path):
    """save_pretrained (tied lm_head dropped, safetensors) → Gemma4.from_pretrained → the same
    greedy tokens as transformers: the dense model's prompt prefilled whole, dense attention
    (the chunked and blocked phases are CASES')."""
    hf, _ = _models(False)
    hf.save_pretrained(tmp_path)
    ours = Gemma4.from_pretrained(tmp_path)
    assert ours.lm_head is None  # tied: read from embed_tokens
    rng = np.random.default_rng(5)
    grids = [(6, 3)]
    patches = patches_for(grids, rng, 12)
    row = prompt(rng, 9, [2], 96)
    want, _ = hf_generate(hf, row, patches, grids, NEW_TOKENS)
    got = ours.generate(row[None], patches, grids, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(got[0], want)


def test_text_only_checkpoint_generates_as_transformers():
    """A Gemma4ForCausalLM tree (`model.*`, no vision) and its text config dict."""
    config = Gemma4TextConfig(**text_config(moe=True, layer_types=LAYERS[True], shared=2))
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    hf = randomize_(Gemma4ForCausalLM(config).eval(), 3)
    ours = Gemma4.from_params(config.to_dict(), tree_of(hf.state_dict()))
    ids = np.random.default_rng(3).integers(FIRST_TEXT, 96, size=(1, 11))
    with torch.no_grad():
        want = hf.generate(
            torch.from_numpy(ids),
            attention_mask=torch.ones(ids.shape, dtype=torch.long),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, ids.shape[1] :].numpy()
    got = ours.generate(ids, max_new_tokens=8, chunk_size=4, decode_blocking="kv")
    np.testing.assert_array_equal(got[0], want)


def _stop_case(hf, rng, batch):
    """Rows and a stop id the model emits: each row's tokens from transformers alone without a
    stop id, the stop id the token row 0 first emits at a drawn step, and each row's tokens from
    transformers stopping at it → (ids [batch, L] right-padded, lengths, stop id, tokens per
    row)."""
    rows = [prompt(rng, int(rng.integers(3, 12)), [], 96) for _ in range(batch)]
    free, _ = hf_generate(hf, rows[0], [], [], NEW_TOKENS)
    stop = int(free[rng.integers(0, NEW_TOKENS - 1)])
    want = [hf_generate(hf, r, [], [], NEW_TOKENS, eos=stop)[0] for r in rows]
    padded = np.zeros((batch, max(map(len, rows))), np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    return padded, [len(r) for r in rows], stop, want


def test_generation_stops_at_a_stop_id_as_transformers():
    """A stop id the model emits mid-generation: every row ends at its first one, the batch
    padded with the pad id after it and cut where the last row stops (transformers' shape).
    (The dense model stops the same way through the exported graphs: tests/e2e/test_serve.py,
    tests/e2e/test_chat.py.)"""
    hf, ours = _models(True)
    padded, lengths, stop, want = _stop_case(hf, np.random.default_rng(2), 3)
    assert len(want[0]) < NEW_TOKENS and want[0][-1] == stop
    got = ours.generate(padded, max_new_tokens=NEW_TOKENS, chunk_size=5, lengths=lengths,
                        stop=(stop,), pad=0)  # fmt: skip
    np.testing.assert_array_equal(got, padded_rows(want))
    alone = ours.generate(padded[:1, : lengths[0]], max_new_tokens=NEW_TOKENS, stop=(stop,))
    np.testing.assert_array_equal(alone[0], want[0])
    never = ours.generate(padded[:1, : lengths[0]], max_new_tokens=NEW_TOKENS, stop=())
    assert never.shape == (1, NEW_TOKENS)


def test_the_model_stops_at_its_configs_eos_by_default():
    hf, _ = _models(False)
    config = hf.config.to_dict()
    ours = Gemma4.from_params(config, tree_of(hf.state_dict()), generation_config=None)
    assert ours.stop == (1,) and ours.pad == 0  # Gemma4TextConfig's eos and pad
    g = {"eos_token_id": [1, 106, 50], "pad_token_id": 3}
    named = Gemma4.from_params(config, tree_of(hf.state_dict()), generation_config=g)
    assert named.stop == (1, 106, 50) and named.pad == 3


def test_sampling_with_top_k_one_is_greedy_and_a_seed_repeats():
    from ref.gemma4.decoding import Sampling

    hf, ours = _models(True)
    rng = np.random.default_rng(4)
    # 10 ids and NEW_TOKENS, as the stop test's row 0 alone: its compiled steps serve these
    ids = prompt(rng, 10, [], 96)[None]
    run = functools.partial(ours.generate, ids, max_new_tokens=NEW_TOKENS, stop=())
    greedy = run()
    top1 = run(sampling=Sampling(0.7, 1, 0.9, seed=5))
    np.testing.assert_array_equal(top1, greedy)
    hot = Sampling(temperature=5.0, top_k=0, top_p=1.0, seed=5)
    a = run(sampling=hot)
    np.testing.assert_array_equal(a, run(sampling=hot))
    other = run(sampling=Sampling(5.0, 0, 1.0, seed=6))
    assert (a != greedy).any() and (a != other).any()
