"""Gemma 4 text decoder against transformers: config resolution, RoPE, layer-by-layer parity,
and the chunked-prefill invariants (image index, vision runs, cache) against whole prefill."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4TextRotaryEmbedding,
    get_block_sequence_ids_for_mask,
)

from ref.attention import reference
from ref.blocking import DENSE_NAMES, BlockingConfig
from ref.blocking import names as blocking_names
from ref.cache import scatter_positions
from ref.gemma4.kv_cache import init_cache
from ref.gemma4.model import attention_for
from ref.gemma4.schedule import chunk_arrays, chunk_bounds, image_runs
from ref.gemma4.step import step
from ref.gemma4.text import merge_vision, vision_runs
from ref.gemma4.text_config import FULL, SLIDING, TextConfig
from ref.rope import rope_inv_freq
from tests.hf_vision import hf_padded_inputs, patches_for, tree_of
from tests.text_oracle import IMAGE, hf_model, prompt, text_config
from tests.util import examples, jitted

TOL = 1e-4  # float32 relative, per the issue
GRIDS = [(3, 3), (3, 6), (6, 6)]
MAX_ROW = 24
# image_idx in the dtype a step hands it back: an int32 index plus the count of a chunk's
# placeholders (jnp.sum: the default int) comes back int64 with the tests' x64 on, so chunk
# loops that started from int32 compiled their step twice (int32, then int64)
IDX = jnp.int64


@st.composite
def layer_setups(draw, max_layers=6):
    """(layer_types, num_kv_shared_layers) — possibly invalid, to test both configs refuse."""
    n = draw(st.integers(2, max_layers))
    types = draw(st.lists(st.sampled_from([SLIDING, FULL]), min_size=n, max_size=n))
    types[-1] = FULL
    return types, draw(st.integers(0, n - 1))


@settings(max_examples=examples(40))
@given(layer_setups(), st.booleans(), st.sampled_from([8, 16]), st.sampled_from([None, 1, 2]))
def test_config_resolves_layers_as_transformers(setup, k_eq_v, global_head_dim, global_kv):
    types, shared = setup
    kwargs = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=global_head_dim,
        num_global_key_value_heads=global_kv,
        attention_k_eq_v=k_eq_v,
        num_hidden_layers=len(types),
        layer_types=types,
        num_kv_shared_layers=shared,
    )
    hf = Gemma4TextConfig(**kwargs)
    try:
        modes = hf.kv_sharing_modes
    except ValueError:
        modes = None
    if modes is None:
        with pytest.raises(ValueError, match="shares KV"):
            TextConfig.from_hf(hf.to_dict())
        return
    # a saved config (per_layer_config) and a hub-style one (global_*) resolve alike
    ours = TextConfig.from_hf(hf.to_dict())
    assert TextConfig.from_hf({"model_type": "gemma4_text", **kwargs}) == ours
    for i in range(len(types)):
        layer = hf.per_layer_config[i]
        assert ours.head_dims[i] == layer.head_dim
        assert ours.kv_heads[i] == layer.num_key_value_heads
        stores = [j for j in range(i) if modes[j] == "store" and types[j] == types[i]]
        assert ours.kv_source[i] == (stores[-1] if modes[i] == "reuse" else i)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
        ({"layer_types": ["x", "full_attention"]}, "layer_types"),
        ({"num_key_value_heads": 3}, "multiple of the kv heads"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}}, "rope"),
    ],
)
def test_config_errors_name_the_value(bad, match):
    base = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4}
    base["layer_types"] = [SLIDING, FULL]
    with pytest.raises(ValueError, match=match):
        TextConfig.from_hf({**base, **bad})


@settings(max_examples=examples(10))
@given(
    st.sampled_from([8, 16, 24]),
    st.sampled_from([0.25, 0.5, 1.0]),
    st.sampled_from([1.0, 4.0]),
    st.sampled_from([10_000.0, 1_000_000.0]),
)
def test_rope_inv_freq_matches_transformers(head_dim, partial, factor, theta):
    rope = {
        SLIDING: {"rope_type": "default", "rope_theta": theta},
        FULL: {
            "rope_type": "proportional",
            "partial_rotary_factor": partial,
            "rope_theta": theta,
            "factor": factor,
        },
    }
    kwargs = dict(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        global_head_dim=2 * head_dim,
        num_hidden_layers=2,
        layer_types=[SLIDING, FULL],
        rope_parameters=rope,
    )
    hf = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**kwargs))
    ours = TextConfig.from_hf(kwargs)
    for i, kind in enumerate((SLIDING, FULL)):
        want = getattr(hf, f"{kind}_inv_freq").numpy()
        got = rope_inv_freq(ours.rope_for(kind), ours.head_dims[i])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@st.composite
def text_setups(draw):
    """A tiny random text config (dense or MoE, KV sharing, k_eq_v, PLE, softcap, window)."""
    types = draw(
        st.sampled_from(
            [
                [SLIDING, FULL, SLIDING, FULL],
                [SLIDING, SLIDING, FULL],
                [FULL, SLIDING, FULL],
            ]
        )
    )
    return text_config(
        moe=draw(st.booleans()),
        layer_types=types,
        shared=draw(st.integers(0, 2 if types[0] == SLIDING and FULL in types[:-1] else 0)),
        k_eq_v=draw(st.booleans()),
        ple=draw(st.sampled_from([0, 8])),
        softcap=draw(st.sampled_from([None, 30.0])),
        window=draw(st.integers(2, 8)),
    )


def _image_features(model, patches, grids):
    if not grids:
        return []
    values, pos = hf_padded_inputs(patches, grids)
    with torch.no_grad():
        return [f.numpy() for f in model.model.get_image_features(values, pos).pooler_output]


def _vision_rows(feats):
    """One row's soft tokens [1, V, D] and image_idx [1, 1], or (None, None)."""
    if not feats:
        return None, None
    return jnp.asarray(np.concatenate(feats))[None], jnp.zeros((1, 1), jnp.int32)


def _rel(a, b):
    b = np.asarray(b, np.float64)
    return np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30)


@settings(max_examples=examples(4))
@given(
    text_setups(),
    st.integers(0, 2**31 - 1),
    st.lists(st.sampled_from([(3, 3), (3, 6), (6, 6)]), max_size=2),
)
def test_layer_by_layer_parity_with_transformers(text, seed, grids):
    """Every layer's output and the logits, whole prompt in one step, float32: ≤ 1e-4 rel."""
    model = hf_model(text, seed % 1000)
    rng = np.random.default_rng(seed)
    patches = patches_for(grids, rng, 12)
    ids = prompt(rng, int(rng.integers(4, 20)), [h * w // 9 for h, w in grids], 96)
    feats = _image_features(model, patches, grids)
    pixels = {}
    if grids:
        pixels["pixel_values"], pixels["image_position_ids"] = hf_padded_inputs(patches, grids)
    with torch.no_grad():
        out = model(
            input_ids=torch.from_numpy(ids)[None],
            mm_token_type_ids=torch.from_numpy((ids == IMAGE).astype(np.int64))[None],
            output_hidden_states=True,
            **pixels,
        )
    tree = tree_of(model.state_dict())
    config = TextConfig.from_hf(model.config.to_dict())
    vision, image_idx = _vision_rows(feats)
    ours = step(
        tree["model"]["language_model"],
        tree["lm_head"]["weight"],
        init_cache(config, 1, len(ids) + 3),
        jnp.asarray(ids)[None],
        jnp.arange(len(ids))[None],
        vision,
        image_idx,
        config=config,
        return_hidden=True,
    )
    # transformers' last hidden state is after the final norm: compare the layers before it
    for i, (got, want) in enumerate(
        zip(ours["hidden_states"][:-1], out.hidden_states[:-1], strict=True)
    ):
        assert _rel(got, want.numpy()) <= TOL, f"hidden state {i}"
    assert _rel(ours["logits"], out.logits.numpy()) <= TOL
    if grids:
        assert int(ours["image_idx"][0, 0]) == int((ids == IMAGE).sum())


@st.composite
def chunked_rows(draw, batch=3):
    """Rows of placeholder flags with a random chunking each (may cut image runs)."""
    rows, cuts = [], []
    for _ in range(batch):
        n = draw(st.integers(1, MAX_ROW))
        flags = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        rows.append(np.array(flags))
        cuts.append(sorted(set(draw(st.lists(st.integers(1, n), max_size=4))) | {n}))
    return rows, cuts


def _pad_chunks(rows, cuts):
    """Per step: (flags [B, S], positions [B, S]) with −1 where a row has nothing."""
    steps = max(len(c) for c in cuts)
    width = MAX_ROW  # one shape for every example: the eager ops compile once
    out = []
    for k in range(steps):
        flags = np.zeros((len(rows), width), bool)
        pos = np.full((len(rows), width), -1, np.int32)
        for i, c in enumerate(cuts):
            if k < len(c):
                s, e = ([0, *c])[k], c[k]
                flags[i, : e - s], pos[i, : e - s] = rows[i][s:e], np.arange(s, e)
        out.append((flags, pos))
    return out


@jax.jit
def _runs_of_chunk(flags, pos, group):
    """One chunk's run ids recorded into the group row (one compiled program: every chunk of
    every example has the same [3, MAX_ROW] shape)."""
    return scatter_positions(group, vision_runs(flags & (pos >= 0), pos, group), pos)


@settings(max_examples=examples(40))
@given(chunked_rows())
def test_vision_runs_agree_with_transformers_across_chunks(data):
    """Run ids from chunk after chunk (runs cut anywhere) = HF's block ids of the whole row."""
    rows, cuts = data
    group = jnp.full((len(rows), MAX_ROW), -1, jnp.int32)
    for flags, pos in _pad_chunks(rows, cuts):
        group = _runs_of_chunk(jnp.asarray(flags), jnp.asarray(pos), group)
    for i, row in enumerate(rows):
        hf = get_block_sequence_ids_for_mask(torch.from_numpy(row.astype(np.int64))[None], "cpu")
        hf = hf[0].numpy()
        got = np.asarray(group[i, : len(row)])
        assert ((got >= 0) == (hf >= 0)).all()
        assert (np.equal.outer(got, got) == np.equal.outer(hf, hf)).all()


_merge_vision = jax.jit(merge_vision)  # the same [3, MAX_ROW] shapes in every call


@settings(max_examples=examples(40))
@given(chunked_rows(), st.integers(0, 2**31 - 1))
def test_image_index_runs_per_row_across_text_only_chunks(data, seed):
    """Chunk by chunk, each row reads its own soft tokens in order and image_idx only grows."""
    rows, cuts = data
    rng = np.random.default_rng(seed)
    vision = jnp.asarray(rng.standard_normal((len(rows), MAX_ROW, 4)))
    text = rng.standard_normal((len(rows), MAX_ROW, 4))
    merged = np.array(text)
    image_idx = jnp.zeros((len(rows), 1), IDX)
    seen = np.zeros(len(rows), int)
    for flags, pos in _pad_chunks(rows, cuts):
        emb = np.take_along_axis(text, np.maximum(pos, 0)[:, :, None], axis=1)
        out, new_idx = _merge_vision(jnp.asarray(emb), jnp.asarray(flags), vision, image_idx)
        assert (np.asarray(new_idx) >= np.asarray(image_idx)).all()
        for i in range(len(rows)):
            valid = pos[i] >= 0
            merged[i, pos[i][valid]] = np.asarray(out)[i, valid]
            seen[i] = max(seen[i], pos[i].max() + 1)
            assert int(new_idx[i, 0]) == int(rows[i][: seen[i]].sum())
        image_idx = new_idx
    for i, row in enumerate(rows):
        want = np.array(text[i, : len(row)])
        want[row] = np.asarray(vision[i, : row.sum()])
        np.testing.assert_array_equal(merged[i, : len(row)], want)


@settings(max_examples=examples(40))
@given(
    st.integers(1, 40),
    st.integers(1, 12),
    st.one_of(st.none(), st.integers(1, 8)),
    st.integers(0, 2**31 - 1),
)
def test_chunk_bounds_cover_and_keep_runs_whole(length, chunk, max_vision, seed):
    """Chunks cover the row, hold at most `chunk` tokens and `max_vision` run tokens (one run
    alone may pass either) and never split a run."""
    ids = np.where(np.random.default_rng(seed).random(length) < 0.4, IMAGE, 9)
    ids[ids == IMAGE] = np.where(np.arange(length) % 7 == 0, 7, IMAGE)[ids == IMAGE]  # video
    runs = image_runs(ids, IMAGE, 7)
    bounds = chunk_bounds(length, runs, chunk, max_vision)
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    for s, e in bounds:
        inside = [(a, n) for a, n in runs if s <= a < e]
        assert e - s <= chunk or inside == [(s, e - s)]
        vision = int(np.isin(ids[s:e], (IMAGE, 7)).sum())
        assert max_vision is None or vision <= max_vision or len(inside) == 1
    for a, n in runs:
        assert any(s <= a and a + n <= e for s, e in bounds), f"run {(a, n)} split by {bounds}"


@settings(max_examples=examples(40))
@given(st.lists(st.sampled_from([9, IMAGE, 7, 11]), max_size=30))
def test_image_runs_are_the_maximal_runs_of_either_id(ids):
    """Runs of image or video ids, token by token in plain Python: each maximal stretch whose
    tokens are all image or video ids (mixed ids form one stretch here)."""
    want, start = [], None
    for i, t in enumerate([*ids, None]):
        inside = t in (IMAGE, 7)
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            want.append((start, i - start))
            start = None
    assert image_runs(np.asarray(ids, np.int64), IMAGE, 7) == want
    assert image_runs(np.asarray(ids, np.int64)) == []


def test_chunk_bounds_cut_only_where_they_must():
    """A whole prompt without chunk_size; a chunk holding exactly max_vision run tokens is not
    cut; one token more starts the next chunk at that run."""
    assert chunk_bounds(5, [(1, 2)], None) == [(0, 5)]
    assert chunk_bounds(20, [(1, 3), (5, 3)], 20, 6) == [(0, 20)]
    assert chunk_bounds(20, [(1, 3), (5, 4)], 20, 6) == [(0, 5), (5, 20)]
    assert chunk_bounds(20, [(0, 7), (9, 2)], 20, 6) == [(0, 9), (9, 20)]


def test_chunk_arrays_lay_out_one_step_of_every_row():
    """Step k: each row's k-th chunk left-aligned with its positions, −1 past it, for rows
    without a k-th chunk, and for the batch rows past the prompts."""
    rows = [np.arange(10, 17), np.arange(20, 23)]
    schedule = [[(0, 4), (4, 7)], [(0, 3)]]
    ids, pos = chunk_arrays(rows, schedule, 0, 3, 5)
    np.testing.assert_array_equal(ids, [[10, 11, 12, 13, 0], [20, 21, 22, 0, 0], [0] * 5])
    np.testing.assert_array_equal(pos, [[0, 1, 2, 3, -1], [0, 1, 2, -1, -1], [-1] * 5])
    ids, pos = chunk_arrays(rows, schedule, 1, 3, 5)
    np.testing.assert_array_equal(ids, [[14, 15, 16, 0, 0], [0] * 5, [0] * 5])
    np.testing.assert_array_equal(pos, [[4, 5, 6, -1, -1], [-1] * 5, [-1] * 5])
    assert ids.dtype == pos.dtype == np.int32


def _tiny():
    text = text_config(moe=False, layer_types=[SLIDING, FULL], ple=0)
    return TextConfig.from_hf({**text, "model_type": "gemma4_text", "image_token_id": IMAGE})


@pytest.mark.parametrize(
    "vision_shape, image_idx, match",
    [
        ((1, 8, 32), (1, 1), "vision_size=8"),
        ((1, 9, 32), (1, 1), "vision_size=9"),
        ((2, 3, 32), (1, 1), "vision_embeds"),
        ((1, 3, 16), (1, 1), "vision_embeds"),
        ((1, 3, 32), None, "image_idx"),
        ((1, 3, 32), (1, 2), "image_idx"),
    ],
)
def test_step_rejects_bad_vision_inputs(vision_shape, image_idx, match):
    config = _tiny()
    with pytest.raises(ValueError, match=match):
        step(
            {},
            None,
            init_cache(config, 1, 8),
            jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1, 2), jnp.int32),
            jnp.zeros(vision_shape),
            None if image_idx is None else jnp.zeros(image_idx, jnp.int32),
            config=config,
        )


def test_unknown_blocking_mode_is_refused():
    with pytest.raises(ValueError, match="prefill_blocking='diagonal'"):
        attention_for("diagonal", prefill=True, batch=1, queries=4, ctx_len=8)
    # `online` is a prefill short name only: decode reads names as they are
    with pytest.raises(ValueError, match="decode_blocking='online'"):
        attention_for("online", prefill=False, batch=1, queries=1, ctx_len=8)


@settings(max_examples=examples(2))
@given(text_setups(), st.integers(0, 2**31 - 1), st.sampled_from([1, 3, 5]), st.booleans())
def test_chunked_prefill_equals_whole_prefill_float64(text, seed, chunk, ring):
    """Prefill in chunks (2 rows, different prompts, padding columns on either side, sliding
    layers in a ring or not) leaves the same positions, runs, image index and last logits
    (and without the ring the same keys/values) as one whole step, in float64 (a difference
    is a bug, not rounding)."""
    model = hf_model(text, seed % 1000)
    tree = jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, jnp.float64), tree_of(model.state_dict())
    )
    config = TextConfig.from_hf(model.config.to_dict())
    rng = np.random.default_rng(seed)
    rows = [prompt(rng, int(rng.integers(3, 14)), [2], 96), prompt(rng, 6, [1, 4], 96)]
    vision = jnp.asarray(rng.standard_normal((2, 5, 32)))
    width = max(map(len, rows))
    ctx = width + 2
    lm, head = tree["model"]["language_model"], tree["lm_head"]["weight"]

    def run(bounds, pad=0, ring=False):
        """pad: extra −1 columns per step, the chunk placed at a random offset among them."""
        cache = init_cache(config, 2, ctx, jnp.float64, ring=ring)
        idx = jnp.zeros((2, 1), IDX)
        last = [None, None]
        seq = max(e - s for b in bounds for s, e in b) + pad
        for k in range(max(map(len, bounds))):
            ids, pos = np.zeros((2, seq), np.int32), np.full((2, seq), -1, np.int32)
            for i, b in enumerate(bounds):
                if k < len(b):
                    s, e = b[k]
                    o = int(rng.integers(0, seq - (e - s) + 1))
                    ids[i, o : o + e - s], pos[i, o : o + e - s] = rows[i][s:e], np.arange(s, e)
            out = step(lm, head, cache, ids, pos, vision, idx, config=config, last_only=True)
            cache, idx = out["cache"], out["image_idx"]
            for i, b in enumerate(bounds):
                if k == len(b) - 1:
                    last[i] = out["logits"][i, 0]
        # run ids depend on the chunking, only which tokens share one must not
        same = np.equal(np.asarray(cache["group"])[:, :, None], np.asarray(cache["group"])[:, None])
        kept = {"pos": cache["pos"], "same_run": same}
        if not ring:
            kept.update(k=cache["k"], v=cache["v"])
        return kept, idx, jnp.stack(last)

    whole = run([[(0, len(r))] for r in rows])
    bounds = [chunk_bounds(len(r), image_runs(r, IMAGE), chunk) for r in rows]
    chunked = run(bounds, pad=2, ring=ring)
    if ring:
        whole = ({key: whole[0][key] for key in chunked[0]}, *whole[1:])
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(whole), leaves(chunked), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "mode, prefill",
    # every name but batch_fold's, whose cache layout generate does not use
    [(m, True) for m in blocking_names(prefill=True) if m not in DENSE_NAMES + ("kv_batch_fold",)]
    + [(m, False) for m in blocking_names() if m not in DENSE_NAMES + ("kv_batch_fold",)],
)
@settings(max_examples=examples(1))
@given(st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_default_block_options_fit_every_phase_shape(mode, prefill, batch, group, seq, seed):
    """generate's default options for each mode are valid for any batch, chunk, GQA group and
    cache length, and give the dense answer (float64, sliding window and vision runs on)."""
    seq = seq if prefill else 1
    ctx = seq + 3
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, 2 * group, seq, 8))
    k, v = rng.standard_normal((2, batch, 2, ctx, 8))
    q_pos = np.broadcast_to(np.arange(3, 3 + seq), (batch, seq))
    kv_pos = np.broadcast_to(np.arange(ctx), (batch, ctx))
    kv_group = np.where((kv_pos >= 2) & (kv_pos < 6), 2, -1)
    args = dict(sliding_window=4, q_group=kv_group[:, 3 : 3 + seq], kv_group=kv_group, scale=1.0)
    attention = attention_for(mode, prefill=prefill, batch=batch, queries=seq, ctx_len=ctx)
    got = jitted(attention, q, k, v, q_pos, kv_pos, **args)
    want = jitted(reference, q, k, v, q_pos, kv_pos, **args)
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_blocking_config_gives_its_own_options_to_its_phase():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 5, 8))
    pos = np.arange(5)[None]
    config = BlockingConfig(mode="prefill_kv", num_kv_blocks=3)
    for prefill in (True, False):  # every mode is exact in either phase
        attention = attention_for(config, prefill=prefill, batch=1, queries=5, ctx_len=5)
        got = jitted(attention, q, k, v, pos, pos)
        np.testing.assert_allclose(got, jitted(reference, q, k, v, pos, pos))


@settings(max_examples=examples(2))
@given(text_setups(), st.integers(0, 2**31 - 1), st.booleans(), st.booleans())
def test_a_step_at_a_compute_context_length_equals_the_whole_cache_float64(
    text, seed, ring, slots_only
):
    """Prefill in chunks then decode, each step attending to the first K cache slots (K the
    least of a list above the step's positions, K − 1 reached exactly) with the cache's other
    slots random: every logit equals the same steps over the whole cache, and the caches written
    are equal (written whole), in float64 (to its rounding: a step over fewer keys may sum in
    another order, 5.6e-17 measured; a slot written wrong differs by the random value it holds)."""
    model = hf_model(text, seed % 1000)
    tree = jax.tree_util.tree_map(
        lambda a: jnp.asarray(a, jnp.float64), tree_of(model.state_dict())
    )
    config = TextConfig.from_hf(model.config.to_dict())
    lm, head = tree["model"]["language_model"], tree["lm_head"]["weight"]
    rng = np.random.default_rng(seed)
    ids = prompt(rng, 7, [1], 96)
    # K = L + 1: the prefill's chunks and the first decode step (K − 1 = L reached exactly);
    # K = ctx_len = 32: the rest (each K is a compiled step of its own)
    ctx, ccls = 32, (len(ids) + 1, 32)
    empty = init_cache(config, 1, ctx, jnp.float64, ring=ring, slots_only=slots_only)
    noise = {n: {i: jnp.asarray(rng.standard_normal(x.shape)) for i, x in empty[n].items()}
             for n in ("k", "v")}  # fmt: skip
    vision = jnp.asarray(rng.standard_normal((1, 4, 32)))
    bounds = chunk_bounds(len(ids), image_runs(ids, IMAGE), 5)

    def run(cut):
        cache, idx, logits = dict(empty, **noise), jnp.zeros((1, 1), IDX), []
        steps = [chunk_arrays([ids], [bounds], k, 1, 5) for k in range(len(bounds))]
        steps += [(np.array([[9 + n]], np.int32), np.array([[len(ids) + n]], np.int32))
                  for n in range(5)]  # fmt: skip
        for chunk, pos in steps:
            key_len = next(k for k in ccls if k > pos.max()) if cut else None
            soft = (vision, idx) if chunk.shape[1] > 1 else (None, None)
            out = step(lm, head, cache, chunk, pos, *soft, config=config, key_len=key_len)
            cache, idx = out["cache"], out.get("image_idx", idx)
            logits.append(out["logits"][0, pos[0] >= 0])
        return jnp.concatenate(logits), cache

    cut, whole = run(True), run(False)
    np.testing.assert_allclose(np.asarray(cut[0]), np.asarray(whole[0]), rtol=1e-10, atol=1e-12)
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(cut[1]), leaves(whole[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "key_len, match", [(0, r"key_len=0: expected an int in \[1, ctx_len=8\]"), (9, "key_len=9"),
                       (3, "key_len=3 with position 3"), (True, "key_len=True")],
)  # fmt: skip
def test_step_refuses_a_key_len_at_or_below_its_positions(key_len, match):
    config = _tiny()
    with pytest.raises(ValueError, match=match):
        step({}, None, init_cache(config, 1, 8), jnp.zeros((1, 2), jnp.int32),
             jnp.array([[2, 3]], jnp.int32), config=config, key_len=key_len)  # fmt: skip
