"""Gemma 4's mixture of experts in every mode of `ref.moe_modes` (dense, gather, nsp): equal to
the dense mode in float64 and to a numpy oracle that shares no code with `ref` (its own router,
softmax, top-k and gelu_tanh, a loop over each token's picks), on routings drawn to hit the
edges: ties in the router, an expert no token picks, every token on one expert (more than one
packed chunk), a core with no routed token, padded rows; then a whole step with batch > 1 and
padded columns, and greedy tokens equal to transformers' with the modes per phase."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ref.gemma4 import moe
from ref.gemma4.kv_cache import init_cache
from ref.gemma4.model import Gemma4
from ref.gemma4.step import apply_step
from ref.gemma4.text_config import FULL, SLIDING, TextConfig
from ref.moe_modes import MoeMode, for_phase, parse
from tests.hf_vision import tree_of
from tests.text_oracle import FIRST_TEXT, hf_generate, hf_model, text_config
from tests.util import examples, jitted

EPS = 1e-6


# --- the oracle: numpy, one token and one pick at a time -------------------------------------


def oracle_route(x, proj, scale, per_expert_scale, top_k):
    """Per token: RMS norm without weight, × scale / √D, softmax of the projection, the top-k
    (ties: the lower expert first), renormalized, × per_expert_scale → ([N, K] ints, floats)."""
    picks, weights = [], []
    for row in np.asarray(x, np.float64):
        h = row / math.sqrt(np.mean(row * row) + EPS) * scale / math.sqrt(len(row))
        logits = proj @ h
        p = np.exp(logits - logits.max())
        p = p / p.sum()
        top = sorted(range(len(p)), key=lambda e: (-p[e], e))[:top_k]
        w = np.array([p[e] for e in top])
        picks.append(top)
        weights.append(w / w.sum() * per_expert_scale[top])
    return np.array(picks), np.array(weights)


def oracle_experts(x, gate_up, down, picks, weights):
    """Σ over each token's picks of weight · down_e(gelu_tanh(gate_e x) · up_e x)."""
    inter = gate_up.shape[1] // 2
    out = np.zeros(x.shape)
    for n, row in enumerate(np.asarray(x, np.float64)):
        for e, w in zip(picks[n], weights[n], strict=True):
            g, u = gate_up[e, :inter] @ row, gate_up[e, inter:] @ row
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
            out[n] += w * (down[e] @ (act * u))
    return out


# --- drawn problems ---------------------------------------------------------------------------

MODES = ["gather", "nsp"]


@st.composite
def problems(draw):
    """(x [T, D], experts, router params, top_k, num_nsp, packed_chunk) with T a multiple of
    the chunk, and routing edges: duplicate tokens (all on the same experts), zero tokens and
    zero projection rows (exact ties), a per_expert_scale with zeros and negatives."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    # few distinct shapes: each is a compile
    num_nsp = draw(st.sampled_from([1, 2, 4]))
    e = draw(st.sampled_from([4, 8]))
    top_k = draw(st.sampled_from([1, 2, 4]))
    chunk = draw(st.sampled_from([2, 4]))
    t = 8
    d, inter = 4, 3
    x = rng.standard_normal((t, d))
    edge = draw(st.sampled_from(["random", "one_token", "zero_rows", "zero_proj", "padded"]))
    if edge == "one_token":  # every token on the same experts: > chunk tokens on one expert
        x[:] = x[0]
    elif edge == "zero_rows":  # uniform probabilities: every expert tied
        x[rng.random(t) < 0.5] = 0.0
    elif edge == "padded":  # padding rows hold whatever the layer left there
        x[rng.random(t) < 0.5] *= 1e3
    proj = rng.standard_normal((e, d))
    if edge == "zero_proj":  # logit 0 for these experts: exact ties among them
        proj[rng.random(e) < 0.5] = 0.0
    scale = rng.standard_normal(d)
    per_expert = rng.standard_normal(e) * (rng.random(e) < 0.8)
    gate_up = rng.standard_normal((e, 2 * inter, d)) / math.sqrt(d)
    down = rng.standard_normal((e, d, inter)) / math.sqrt(inter)
    return x, (gate_up, down), (proj, scale, per_expert), top_k, num_nsp, chunk


def _mode(name, num_nsp, chunk):
    return MoeMode("nsp", num_nsp, chunk) if name == "nsp" else MoeMode(name)


def _experts(x, gate_up, down, weights, index, *, mode):
    return moe.run(mode, x, gate_up, down, weights, index)


def _run(mode, x, gate_up, down, weights, index):
    return np.asarray(jitted(_experts, x, gate_up, down, weights, index, mode=mode))


@pytest.mark.parametrize("name", MODES)
@settings(max_examples=examples(7))
@given(problem=problems())
def test_mode_equals_dense_and_the_oracle_float64(name, problem):
    x, (gate_up, down), (proj, scale, per_expert), top_k, num_nsp, chunk = problem
    weights, index = jitted(moe.route, x, proj, scale, per_expert, top_k=top_k, eps=EPS)
    picks, want_w = oracle_route(x, proj, scale, per_expert, top_k)
    np.testing.assert_array_equal(np.asarray(index), picks)
    np.testing.assert_allclose(np.asarray(weights), want_w, rtol=1e-12, atol=1e-14)
    want = oracle_experts(x, gate_up, down, picks, want_w)
    dense = _run(MoeMode(), x, gate_up, down, weights, index)
    got = _run(_mode(name, num_nsp, chunk), x, gate_up, down, weights, index)
    tol = 1e-12 * max(np.abs(want).max(), 1.0)
    np.testing.assert_allclose(dense, want, rtol=0, atol=tol)
    np.testing.assert_allclose(got, dense, rtol=0, atol=tol)


@st.composite
def routings(draw):
    """Picks drawn directly (distinct per token), with the edges named: every token on expert
    0 (then > chunk tokens there), a core no token reaches, an expert no token picks."""
    num_nsp = draw(st.sampled_from([2, 4]))
    e = 8
    top_k = draw(st.sampled_from([2, 3]))
    chunk = draw(st.sampled_from([2, 4]))
    t = 8
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    edge = draw(st.sampled_from(["random", "all_on_0", "empty_core"]))
    allowed = np.arange(e)
    if edge == "empty_core":  # core c holds experts c, c + num_nsp, …
        allowed = allowed[allowed % num_nsp != draw(st.integers(0, num_nsp - 1))]
        assume(len(allowed) >= top_k)
    picks = np.stack([rng.permutation(allowed)[:top_k] for _ in range(t)])
    if edge == "all_on_0":
        picks[:, 0] = 0
        picks[:, 1:] = 1 + np.stack([rng.permutation(e - 1)[: top_k - 1] for _ in range(t)])
    weights = rng.standard_normal((t, top_k))
    x = rng.standard_normal((t, 5))
    gate_up, down = rng.standard_normal((e, 6, 5)), rng.standard_normal((e, 5, 3))
    return x, gate_up, down, weights, picks.astype(np.int32), num_nsp, chunk


@pytest.mark.parametrize("name", MODES)
@settings(max_examples=examples(7))
@given(problem=routings())
def test_mode_on_drawn_routings_equals_the_oracle(name, problem):
    x, gate_up, down, weights, picks, num_nsp, chunk = problem
    want = oracle_experts(x, gate_up, down, picks, weights)
    got = _run(_mode(name, num_nsp, chunk), x, gate_up, down, weights, picks)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_every_token_on_one_expert_spills_over_packed_chunks():
    """16 tokens, chunk 4, all on experts 0 and 1: four chunks of expert 0's core hold them."""
    rng = np.random.default_rng(0)
    x, gate_up, down = (rng.standard_normal(s) for s in ((16, 4), (4, 6, 4), (4, 4, 3)))
    picks = np.tile(np.array([[0, 1]], np.int32), (16, 1))
    weights = rng.standard_normal((16, 2))
    want = oracle_experts(x, gate_up, down, picks, weights)
    got = _run(MoeMode("nsp", 2, 4), x, gate_up, down, weights, picks)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())


def test_an_expert_that_overflows_off_its_tokens_does_not_reach_them():
    """Expert 3 overflows to inf on every token, and no token picks it: gather never runs it,
    nsp runs it on rows past its routed count and keeps them out (QEfficient zeroes them); a
    fp16 device overflows this way. Dense multiplies inf by a weight of 0: NaN (where gelu
    does not flatten it)."""
    rng = np.random.default_rng(1)
    x, gate_up, down = (rng.standard_normal(s) for s in ((8, 4), (4, 6, 4), (4, 4, 3)))
    gate_up[3] *= 1e300
    picks = np.stack([rng.permutation(3)[:2] for _ in range(8)]).astype(np.int32)
    weights = rng.standard_normal((8, 2))
    want = oracle_experts(x, gate_up, down, picks, weights)
    for mode in (MoeMode("gather"), MoeMode("nsp", 2, 2), MoeMode("nsp", 4, 8)):
        got = _run(mode, x, gate_up, down, weights, picks)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
    assert np.isnan(_run(MoeMode(), x, gate_up, down, weights, picks)).any()


def test_experts_sit_on_cores_as_qefficient_lays_them_out():
    """Expert s·num_nsp + c is core c's slot s (`view(E / num_nsp, num_nsp, …).transpose(0,
    1)`): any other layout gives the same answer, so only this test holds it."""
    slots = [np.asarray(moe.slot_experts(jnp.arange(12), s, 4)) for s in range(3)]
    assert all(layout.shape == (4,) for layout in slots)
    assert all(slots[s][c] == s * 4 + c for c in range(4) for s in range(3))


def test_pack_puts_routed_tokens_first_in_order():
    routed = np.array([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    order, count = jitted(moe.pack, routed)
    np.testing.assert_array_equal(order, [[1, 3, 4, 0, 2], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    np.testing.assert_array_equal(count[:, 0], [3, 0, 5])


# --- mode text and its refusals ---------------------------------------------------------------


def test_modes_parse_and_print():
    assert parse(None) == parse("dense") == MoeMode()
    assert parse("gather") == MoeMode("gather")
    assert parse("nsp") == MoeMode("nsp", 16, 256)
    assert parse("nsp", num_nsp=8) == MoeMode("nsp", 8, 256)
    mode = parse("nsp:num_nsp=4,packed_chunk=32")
    assert mode == MoeMode("nsp", 4, 32)
    assert parse(str(mode)) == mode and str(MoeMode("gather")) == "gather"


@pytest.mark.parametrize(
    "text, match",
    [
        ("sparse", "MoE mode 'sparse' in 'sparse': expected one of dense, gather, nsp"),
        ("gather:num_nsp=2", "gather takes no options"),
        ("nsp:cores=2", "'cores=2' in MoE mode 'nsp:cores=2': expected num_nsp=N or packed"),
        ("nsp:num_nsp=two", "'num_nsp=two' .*: expected an integer"),
        ("nsp:num_nsp=0", "num_nsp=0, expected an int >= 1"),
        (3, "MoE mode 3: expected a MoeMode or text"),
    ],
)
def test_bad_mode_text_is_refused_by_name(text, match):
    with pytest.raises(ValueError, match=match):
        parse(text)


def test_nsp_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="num_nsp=3 does not divide the 8 experts"):
        MoeMode("nsp", 3, 4).check(8, 16)
    with pytest.raises(ValueError, match="packed_chunk=5 does not divide the 16 tokens"):
        MoeMode("nsp", 4, 5).check(8, 16)
    x = np.zeros((6, 4))
    with pytest.raises(ValueError, match="packed_chunk=4 does not divide the 6 tokens"):
        moe.nsp(x, np.zeros((4, 6, 4)), np.zeros((4, 4, 3)), np.ones((6, 1)),
                np.zeros((6, 1), np.int32), num_nsp=2, packed_chunk=4)  # fmt: skip
    with pytest.raises(ValueError, match="MoE mode 'dense' takes no num_nsp"):
        MoeMode("dense", num_nsp=2)


# --- whole steps and generation ---------------------------------------------------------------

# (experts, top_k, attention_k_eq_v): QEfficient's cases (8 top-2 with k_eq_v; 16 top-4)
CONFIGS = {"e8k2": (8, 2, True), "e16k4": (16, 4, False)}
_MODELS = {}


def _models(key):
    """(transformers model, ours, TextConfig) for a MoE config of CONFIGS."""
    if key not in _MODELS:
        experts, top_k, k_eq_v = CONFIGS[key]
        text = text_config(moe=True, layer_types=[SLIDING, FULL], k_eq_v=k_eq_v, ple=0, window=5)
        text.update(num_experts=experts, top_k_experts=top_k)
        hf = hf_model(text, seed=5 + experts)
        ours = Gemma4.from_params(hf.config.to_dict(), tree_of(hf.state_dict()))
        _MODELS[key] = hf, ours, TextConfig.from_hf(hf.config.to_dict())
    return _MODELS[key]


def test_a_padded_batch_step_is_the_same_in_every_mode_float64():
    """Batch 2, 8 columns, row 1 padded after 5 (position −1): logits and cache of each mode
    equal dense's in float64 (16 experts top-4)."""
    _, ours, config = _models("e16k4")
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), ours.params)
    rng = np.random.default_rng(1)
    ids = rng.integers(FIRST_TEXT, 96, (2, 8)).astype(np.int32)
    pos = np.tile(np.arange(8, dtype=np.int32), (2, 1))
    pos[1, 5:] = -1
    cache = init_cache(config, 2, 16, jnp.float64)
    outs = {
        str(mode): jitted(apply_step, p, None, cache, ids, pos, config=config, moe=mode)
        for mode in (MoeMode(), MoeMode("gather"), MoeMode("nsp", 4, 4))
    }
    dense = outs.pop("dense")
    for name, out in outs.items():
        np.testing.assert_allclose(out["logits"], dense["logits"], rtol=0, atol=1e-11, err_msg=name)
        for kind in ("k", "v"):
            for layer, a in out["cache"][kind].items():
                np.testing.assert_allclose(a, dense["cache"][kind][layer], atol=1e-12)


def test_generate_refuses_a_mode_that_cannot_apply():
    _, ours, _ = _models("e8k2")
    ids = np.full((1, 6), FIRST_TEXT)
    with pytest.raises(ValueError, match="moe_prefill='nsp:num_nsp=3': .* does not divide the 8"):
        ours.generate(ids, max_new_tokens=2, moe_prefill="nsp:num_nsp=3")
    with pytest.raises(ValueError, match="moe_decode='nsp:num_nsp=2,packed_chunk=2': .* the 1 "):
        ours.generate(ids, max_new_tokens=2, moe_decode="nsp:num_nsp=2,packed_chunk=2")
    with pytest.raises(ValueError, match="moe_decode='gather': the model has no MoE block"):
        for_phase("gather", "decode", 0, 1)
    assert for_phase(None, "decode", 0, 1) == MoeMode()


# (config, batch, chunk_size, moe_prefill, moe_decode): each mode in each phase, on each
# config (16 experts' nsp prefill, every mode in a float64 step: the padded batch test above)
GENERATE = [
    ("e8k2", 2, 4, "nsp:num_nsp=4,packed_chunk=2", "gather"),
    ("e16k4", 2, None, "gather", "nsp:num_nsp=16,packed_chunk=2"),
]
NEW_TOKENS = 10


@pytest.mark.parametrize("key, batch, chunk, prefill, decode", GENERATE)
def test_greedy_tokens_equal_transformers_with_moe_modes(key, batch, chunk, prefill, decode):
    hf, ours, _ = _models(key)
    rng = np.random.default_rng(len(key) + batch)
    lengths = [12, 9][:batch]
    ids = np.zeros((batch, max(lengths)), np.int64)
    want = []
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(FIRST_TEXT, 96, n)
        tokens, logits = hf_generate(hf, ids[i, :n], [], [], NEW_TOKENS)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 1e-4, "a near tie: pick another seed"
        want.append(tokens)
    got = ours.generate(
        ids,
        max_new_tokens=NEW_TOKENS,
        chunk_size=chunk,
        lengths=lengths,
        moe_prefill=prefill,
        moe_decode=decode,
    )
    np.testing.assert_array_equal(got, np.stack(want))
