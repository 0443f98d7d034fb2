"""Packed vision tower: parity with transformers' padded Gemma4VisionModel, packing invariance.

Tolerances: float32 against transformers (eager attention), relative error
max|ours − HF| / max|HF| ≤ 1e-5 per item and per layer; the two attention paths of the
packed tower (per-item slices vs dense segment mask) agree to 1e-12 in float64.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ref.gemma4 import VisionTower, tower_forward
from ref.gemma4.config import VisionConfig
from ref.gemma4.vision import QUERY_TILE
from tests.hf_vision import (
    hf_encode,
    hf_full_model,
    hf_padded_inputs,
    hf_vision_model,
    patches_for,
    tree_of,
)
from tests.strategies import grids, vision_configs
from tests.util import examples, rel_err

RTOL_F32 = 1e-5


def small_config(**overrides):
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        patch_size=2,
        position_embedding_size=96,
        use_clipped_linears=True,
        standardize=True,
        text_hidden_size=20,
    )
    return VisionConfig(**{**base, **overrides})


@settings(max_examples=examples(8))
@given(cfg=vision_configs(), grid_list=grids(), pad=st.integers(0, 2), seed=st.integers(0, 99))
def test_matches_transformers_per_item_per_layer_and_embedded(cfg, grid_list, pad, seed):
    """Soft tokens per item and every layer's states against transformers' Gemma4VisionModel
    (padded batch, `pad` extra padding tokens), and the embedded soft tokens (embed_vision)
    against Gemma4Model.get_image_features, one compiled tower per example: the tower of a full
    checkpoint (`VisionTower.from_params`, its config read back from transformers')."""
    cfg = VisionConfig(**{**cfg.__dict__, "text_hidden_size": 20})  # embed_vision's width
    model = hf_full_model(cfg, seed, text_hidden=20)
    patches = patches_for(grid_list, np.random.default_rng(seed), cfg.patch_dim)
    expected, hf_states = hf_encode(model.model.vision_tower, patches, grid_list, pad_tokens=pad)
    values, pos = hf_padded_inputs(patches, grid_list)
    with torch.no_grad():
        expected_embeds = model.get_image_features(values, pos).pooler_output
    tower = VisionTower.from_params(model.config.to_dict(), tree_of(model.state_dict()))
    assert tower.config == cfg
    packing, out = tower.run(patches, grid_list, embed=True)
    embeds = tower.embed(patches, grid_list)  # the same compiled tower
    cu = packing.cu_tokens
    assert len(embeds) == len(expected) == len(expected_embeds) == len(grid_list)
    for i, (theirs, theirs_embedded) in enumerate(zip(expected, expected_embeds, strict=True)):
        ours = np.asarray(out["pooled"])[cu[i] : cu[i + 1]]
        assert ours.shape == theirs.shape
        assert rel_err(ours, theirs) <= RTOL_F32
        assert embeds[i].shape == tuple(theirs_embedded.shape)
        assert rel_err(embeds[i], theirs_embedded.numpy()) <= RTOL_F32
    # HF's hidden_states are each layer's input (embeddings, outputs 1…L−1), then the pooled
    # result; ours are the embeddings then every layer's output.
    assert len(out["hidden_states"]) == cfg.num_hidden_layers + 1
    for layer, theirs in enumerate(hf_states[: cfg.num_hidden_layers]):
        ours = np.asarray(out["hidden_states"][layer])
        for i, (h, w) in enumerate(packing.grids):
            a, b = packing.cu_seqlens[i], packing.cu_seqlens[i + 1]
            assert rel_err(ours[a:b], theirs[i, : h * w].numpy()) <= RTOL_F32


@settings(max_examples=examples(4))
@given(
    cfg=vision_configs(max_layers=3),
    grid_list=grids(max_items=3),
    extra=st.integers(0, 5),
    seed=st.integers(0, 99),
)
def test_item_unchanged_by_other_items_and_budget(cfg, grid_list, extra, seed):
    model = hf_vision_model(cfg, seed)
    tower = VisionTower(cfg, tree_of(model.state_dict()))
    patches = patches_for(grid_list, np.random.default_rng(seed), cfg.patch_dim)
    together = tower.encode(patches, grid_list)
    tokens = sum(h * w for h, w in grid_list) // 9
    budgeted = tower.encode(patches, grid_list, budget=tokens + extra)
    for i, grid in enumerate(grid_list):
        alone = tower.encode([patches[i]], [grid])[0]
        assert rel_err(together[i], alone) <= 1e-6
        assert rel_err(budgeted[i], alone) <= 1e-6


@settings(max_examples=examples(4))
@given(cfg=vision_configs(max_layers=2), grid_list=grids(), extra=st.integers(1, 4))
def test_dense_mask_equals_per_item_attention_float64_with_garbage_filler(cfg, grid_list, extra):
    model = hf_vision_model(cfg, 0)
    tower = VisionTower(cfg, tree_of(model.state_dict()), dtype=np.float64)
    patches = patches_for(grid_list, np.random.default_rng(1), cfg.patch_dim)
    tokens = sum(h * w for h, w in grid_list) // 9
    packing, flat = tower.pack(patches, grid_list, budget=tokens + extra)
    garbage = flat.astype(np.float64)
    garbage[packing.num_real_patches :] = 1e3 * np.random.default_rng(2).standard_normal(
        garbage[packing.num_real_patches :].shape
    )
    args = (packing.positions, packing.segment_ids, packing.pool_index)
    dense = tower_forward(tower.params, None, garbage, *args, config=cfg)["pooled"]
    varlen = tower_forward(
        tower.params,
        None,
        flat.astype(np.float64),
        *args,
        config=cfg,
        cu_seqlens=packing.cu_seqlens_static,
    )["pooled"]
    real = packing.num_real_tokens
    assert dense.dtype == np.float64
    assert rel_err(dense[:real], varlen[:real]) <= 1e-12


@pytest.mark.parametrize(
    ("grid_list", "patches_fn", "message"),
    [
        ([], lambda c: [], "empty input"),
        ([(4, 6)], lambda c: [np.zeros((24, c.patch_dim))], "multiples of the pooling kernel"),
        ([(3, 0)], lambda c: [np.zeros((0, c.patch_dim))], "multiples of the pooling kernel"),
        ([(3, 6)], lambda c: [np.zeros((17, c.patch_dim))], "has 17 patches but grid"),
        ([(3, 6)], lambda c: [np.zeros((18, c.patch_dim + 1))], "expected \\[18, 12\\]"),
        ([(3, 99)], lambda c: [np.zeros((297, c.patch_dim))], "exceed the position table of 96"),
        ([(3, 3), (3, 3)], lambda c: [np.zeros((9, c.patch_dim))], "1 patch arrays for 2 grids"),
    ],
)
def test_bad_input_names_the_value(grid_list, patches_fn, message):
    cfg = small_config(num_hidden_layers=1)
    tower = VisionTower(cfg, tree_of(hf_vision_model(cfg, 0).state_dict()))
    with pytest.raises(ValueError, match=message):
        tower.encode(patches_fn(cfg), grid_list)


def test_budget_smaller_than_items_is_refused():
    cfg = small_config(num_hidden_layers=1)
    tower = VisionTower(cfg, tree_of(hf_vision_model(cfg, 0).state_dict()))
    patches = patches_for([(6, 6)], np.random.default_rng(0), cfg.patch_dim)
    with pytest.raises(ValueError, match="budget=3 soft tokens is smaller than the 4"):
        tower.encode(patches, [(6, 6)], budget=3)


def test_embed_without_embed_vision_weights_is_refused():
    cfg = small_config(num_hidden_layers=1)
    tower = VisionTower(cfg, tree_of(hf_vision_model(cfg, 0).state_dict()))
    with pytest.raises(ValueError, match="embed_vision weights"):
        tower.embed(patches_for([(3, 3)], np.random.default_rng(0), cfg.patch_dim), [(3, 3)])


def test_head_dim_72_gqa_and_a_tiled_item_like_the_31b_tower():
    cfg = small_config(
        hidden_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=72,
        num_hidden_layers=2,
    )
    model = hf_vision_model(cfg, 3)
    grid_list = [(3, 60), (9, 6), (3, 3), (36, 30)]  # 1080 patches: more than one query tile
    assert 36 * 30 > QUERY_TILE
    patches = patches_for(grid_list, np.random.default_rng(3), cfg.patch_dim)
    expected, _ = hf_encode(model, patches, grid_list)
    got = VisionTower(cfg, tree_of(model.state_dict())).encode(patches, grid_list)
    for ours, theirs in zip(got, expected, strict=True):
        assert rel_err(ours, theirs) <= RTOL_F32
