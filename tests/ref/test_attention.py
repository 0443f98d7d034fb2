"""`reference` against transformers' Gemma 4 attention; every `blocked` mode against `reference`.

Oracles: transformers' `eager_attention_forward` under the masks `create_masks_for_vision_model`
builds (full and sliding layers, `mm_token_type_ids` vision runs, left padding); for `blocked`, the
dense `reference` on the same arrays. Tolerances: 1e-12 relative in float64, 2e-6 in float32
(relative to the largest output magnitude); 1e-5 against transformers in float32.
"""

import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Gemma4TextConfig
from transformers.models.gemma4 import modeling_gemma4 as hf

from ref.attention import attend, blocked, mask, reference
from ref.blocking import MODES
from ref.cache import fold
from tests.util import examples, jitted, rel_err, vision_runs

TOL = {np.float64: 1e-12, np.float32: 2e-6}


def problem(rng, b, h, hkv, s, t, d, dtype, *, scenario, vision):
    """Random q, k, v and positions for one call.

    scenario "chunk": the cache is linear (slot = position), holding positions 0 … start+S−1
    for a chunk of S queries starting anywhere, with trailing −1 padding in some rows and some
    cache holes. scenario "ring": kv positions are an arbitrary permutation of recent positions
    with empty slots (a rolling buffer). Vision run ids are a function of position, so a run
    straddling chunks or blocks is the same run everywhere.
    """
    scale_qk = 1.0 / np.sqrt(d)
    q = rng.normal(size=(b, h, s, d)) * scale_qk * 2
    k = rng.normal(size=(b, hkv, t, d))
    v = rng.normal(size=(b, hkv, t, d))
    q_pos = np.full((b, s), -1)
    kv_pos = np.full((b, t), -1)
    for row in range(b):
        start = int(rng.integers(0, max(t - s, 0) + 1))
        valid = int(rng.integers(0, s + 1)) if rng.random() < 0.3 else s
        q_pos[row, :valid] = start + np.arange(valid)
        if scenario == "chunk":
            filled = min(t, start + s)
            kv_pos[row, :filled] = np.arange(filled)
            holes = rng.random(t) < 0.1
            kv_pos[row, holes] = -1
        else:
            last = start + s
            kv_pos[row] = rng.permutation(np.arange(last - t, last))
            kv_pos[row, (kv_pos[row] < 0) | (rng.random(t) < 0.15)] = -1
    groups = {}
    if vision:
        runs = vision_runs(rng, s + t + 1)
        groups = {
            "q_group": np.where(q_pos >= 0, runs[np.maximum(q_pos, 0)], -1),
            "kv_group": np.where(kv_pos >= 0, runs[np.maximum(kv_pos, 0)], -1),
        }
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), q_pos, kv_pos, groups


@st.composite
def mode_options(draw, b, h, hkv, s, t):
    """A valid mode and options for these shapes (block counts dividing or not)."""
    mode = draw(st.sampled_from(MODES))
    g = h // hkv
    axes = mode
    opts = {}
    if mode.startswith("prefill_"):
        axes = {"prefill_q": "q", "prefill_kv": "kv", "prefill_qkv": "qkv"}.get(mode, "qkv")
        if draw(st.booleans()):
            opts["prefill_n_rep_chunk"] = draw(
                st.sampled_from([c for c in range(1, g + 1) if g % c == 0])
            )
        if "q" in axes:
            opts["prefill_block_chunks"] = draw(st.integers(1, min(s, 4)))
        axes = axes.replace("q", "")
    if "kv" in axes:
        ctx_len = draw(st.sampled_from([t, t + draw(st.integers(0, 5))]))
        if ctx_len != t:
            opts["ctx_len"] = ctx_len
        opts["num_kv_blocks"] = draw(st.integers(1, min(ctx_len, 5)))
        opts["skip_kv"] = draw(st.booleans())
        if draw(st.booleans()):
            opts["headpar_split"] = draw(st.integers(0, 3))
        axes = axes.replace("kv", "")
    if "q" in axes:
        opts["num_q_blocks"] = draw(st.integers(1, min(s, 4)))
    if "b" in axes:
        opts["num_batch_blocks"] = draw(st.integers(1, b))
    fold_heads = h
    if "b" not in axes and draw(st.booleans()):
        opts["batch_fold"] = True
        fold_heads = b * h
    if "h" in axes:
        sizes = [c for c in range(1, fold_heads + 1) if c % g == 0 or g % c == 0]
        opts["head_block_size"] = draw(st.sampled_from(sizes))
    if draw(st.booleans()):
        opts["ordered"] = True
    return mode, opts


@st.composite
def cases(draw):
    # Few distinct shapes: eager JAX compiles every primitive once per shape, which dominates
    # the runtime; block counts, modes, positions and data still vary freely.
    hkv = draw(st.integers(1, 2))
    shapes = dict(
        b=draw(st.integers(1, 2)),
        h=hkv * draw(st.sampled_from([1, 2, 3])),
        hkv=hkv,
        s=draw(st.sampled_from([1, 4, 7])),
        t=draw(st.sampled_from([7, 12])),
        d=4,
    )
    mode, opts = draw(mode_options(shapes["b"], shapes["h"], hkv, shapes["s"], shapes["t"]))
    extra = dict(
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 8))),
        softcap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        scale=draw(st.sampled_from([1.0, 0.5])),
    )
    return shapes, mode, opts, extra


@settings(max_examples=examples(30))
@given(
    cases(),
    st.sampled_from([np.float64, np.float32]),
    st.sampled_from(["chunk", "ring"]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_blocked_equals_reference(case, dtype, scenario, vision, seed):
    shapes, mode, opts, extra = case
    rng = np.random.default_rng(seed)
    q, k, v, q_pos, kv_pos, groups = problem(
        rng, **shapes, dtype=dtype, scenario=scenario, vision=vision
    )
    want = jitted(reference, q, k, v, q_pos, kv_pos, **groups, **extra)
    if opts.get("batch_fold"):
        k, v = fold(k), fold(v)
    got = jitted(blocked, q, k, v, q_pos, kv_pos, mode=mode, **opts, **groups, **extra)
    assert got.dtype == want.dtype == dtype
    assert got.shape == want.shape
    assert not np.isnan(np.asarray(got)).any()
    assert rel_err(got, want) <= TOL[dtype], (mode, opts)


@settings(max_examples=examples(10))
@given(cases(), st.integers(0, 3), st.integers(0, 2**32 - 1))
def test_cache_rows_read_the_batch_slots(case, spare, seed):
    """Continuous batching: k, v hold F = B + spare cache slots and row b attends to slot
    rows[b]. `reference` and every blocked mode (which gathers a KV block at a time) equal the
    dense answer on the rows picked out here by numpy indexing, in float64."""
    shapes, mode, opts, extra = case
    rng = np.random.default_rng(seed)
    q, k, v, q_pos, kv_pos, groups = problem(
        rng, **shapes, dtype=np.float64, scenario="chunk", vision=False
    )
    b = q.shape[0]
    rows = rng.permutation(b + spare)[:b].astype(np.int32)
    slots_k = rng.standard_normal((b + spare, *k.shape[1:]))
    slots_v = rng.standard_normal((b + spare, *v.shape[1:]))
    slots_k[rows], slots_v[rows] = k, v
    want = jitted(reference, q, k, v, q_pos, kv_pos, **groups, **extra)
    dense = jitted(
        reference, q, slots_k, slots_v, q_pos, kv_pos, cache_rows=rows, **groups, **extra
    )
    assert rel_err(dense, want) == 0.0
    got = jitted(blocked, q, slots_k, slots_v, q_pos, kv_pos, mode=mode, cache_rows=rows,
                 **opts, **groups, **extra)  # fmt: skip
    assert rel_err(got, want) <= TOL[np.float64], (mode, opts)


def test_cache_rows_shape_is_checked():
    rng = np.random.default_rng(0)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, b=2, h=2, hkv=1, s=1, t=4, d=4, dtype=np.float32, scenario="chunk", vision=False
    )
    with pytest.raises(ValueError, match=r"cache_rows has shape \(3,\); expected \(2,\)"):
        reference(q, k, v, q_pos, kv_pos, cache_rows=np.arange(3))
    with pytest.raises(ValueError, match=r"cache_rows has shape \(1,\); expected \(2,\)"):
        blocked(q, k, v, q_pos, kv_pos, mode="kv", num_kv_blocks=2, cache_rows=np.arange(1))


@settings(max_examples=examples(8))
@given(st.sampled_from([1, 5]), st.sampled_from([3, 6]), st.integers(0, 2**32 - 1))
def test_reference_padding_rows_are_zero_and_dense_oracle(s, t, seed):
    """Rows no key is visible to are exactly zero; every other row is the float64 softmax over
    the keys the rule admits, decided here key by key (not by `mask`, which it checks too)."""
    rng = np.random.default_rng(seed)
    q, k, v, q_pos, kv_pos, groups = problem(
        rng, 2, 4, 2, s, t, 4, np.float64, scenario="ring", vision=True
    )
    got = np.asarray(jitted(reference, q, k, v, q_pos, kv_pos, **groups, sliding_window=3))
    kr = np.repeat(k, 2, axis=1)
    vr = np.repeat(v, 2, axis=1)

    def visible(b, i, j):
        qp, kp, qg, kg = (
            q_pos[b, i],
            kv_pos[b, j],
            groups["q_group"][b, i],
            groups["kv_group"][b, j],
        )
        same_run = qg >= 0 and qg == kg
        return qp >= 0 and kp >= 0 and (kp <= qp or same_run) and qp - kp < 3

    for b in range(2):
        for head in range(4):
            for i in range(s):
                seen = np.array([visible(b, i, j) for j in range(t)])
                if not seen.any():
                    assert (got[b, head, i] == 0).all()
                    continue
                logits = kr[b, head, seen] @ q[b, head, i]
                p = np.exp(logits - logits.max())
                want = (p / p.sum()) @ vr[b, head, seen]
                assert np.abs(got[b, head, i] - want).max() <= 1e-12


def test_mask_window_is_one_sided_and_vision_is_bidirectional():
    """AND(window, OR(causal, same run)): a later key of the query's run stays visible."""
    q_pos = np.array([[0, 1, 2, 3, 4, 5]])
    runs = np.array([[-1, 0, 0, 0, 0, -1]])
    m = np.asarray(mask(q_pos, q_pos, sliding_window=2, q_group=runs, kv_group=runs))[0, 0]
    assert m[1, 4]  # same run, later key, inside the window (future keys are never outside)
    assert not m[4, 1]  # same run, but 4 − 1 ≥ 2 is outside the window
    assert m[4, 3] and not m[5, 3]
    assert not m[0, 1]  # text token: causal
    with pytest.raises(ValueError, match="together"):
        mask(q_pos, q_pos, q_group=runs)
    with pytest.raises(ValueError, match="sliding_window"):
        mask(q_pos, q_pos, sliding_window=0)


def hf_attention(q, k, v, mask4, softcap, groups):
    module = types.SimpleNamespace(
        num_key_value_groups=groups, training=False, head_dim=q.shape[-1]
    )
    out, _ = hf.eager_attention_forward(
        module,
        torch.from_numpy(q),
        torch.from_numpy(k),
        torch.from_numpy(v),
        mask4,
        scaling=1.0,
        softcap=softcap,
    )
    return out.transpose(1, 2).numpy()


@settings(max_examples=examples(8))
@given(
    st.integers(1, 2),
    st.integers(2, 12),
    st.integers(1, 6),
    st.sampled_from([(2, 1), (4, 2), (2, 2)]),
    st.one_of(st.none(), st.floats(1.0, 50.0)),
    st.integers(0, 2**32 - 1),
)
def test_reference_matches_transformers(b, s, window, heads, softcap, seed):
    """Full and sliding layers with left padding and mm_token_type_ids vision runs."""
    rng = np.random.default_rng(seed)
    h, hkv = heads
    d = 8
    cfg = Gemma4TextConfig(
        hidden_size=16,
        num_attention_heads=h,
        num_key_value_heads=hkv,
        head_dim=d,
        sliding_window=window,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention="vision",
    )
    cfg._attn_implementation = "eager"
    pad = rng.integers(0, s // 2 + 1, size=b)
    attention_mask = (np.arange(s)[None, :] >= pad[:, None]).astype(np.int64)
    token_types = np.where(rng.random((b, s)) < 0.5, rng.integers(1, 3, size=(b, s)), 0)
    token_types[attention_mask == 0] = 0
    runs = hf.get_block_sequence_ids_for_mask(torch.from_numpy(token_types), device="cpu")
    masks = hf.create_masks_for_vision_model(
        config=cfg,
        inputs_embeds=torch.zeros(b, s, 16),
        attention_mask=torch.from_numpy(attention_mask),
        cache=None,
        position_ids=torch.from_numpy(np.maximum(np.cumsum(attention_mask, 1) - 1, 0)),
        block_sequence_ids=runs,
    )
    q = rng.normal(size=(b, h, s, d)).astype(np.float32) * 0.7
    k = rng.normal(size=(b, hkv, s, d)).astype(np.float32) * 0.7
    v = rng.normal(size=(b, hkv, s, d)).astype(np.float32)
    # transformers masks by cache index; with no cache, index = slot = our position.
    pos = np.where(attention_mask == 1, np.arange(s)[None, :], -1)
    runs = runs.numpy()
    for layer, sw, grp in (
        ("full_attention", None, {}),
        ("sliding_attention", window, {"q_group": runs, "kv_group": runs}),
    ):
        want = hf_attention(q, k, v, masks[layer], softcap, h // hkv)
        got = np.asarray(
            jitted(reference, q, k, v, pos, pos, sliding_window=sw, softcap=softcap, **grp)
        )
        valid = attention_mask.astype(bool)
        assert np.abs(got - want)[valid[:, None, :].repeat(h, 1)].max() <= 1e-5, layer
        assert (got[~valid[:, None, :].repeat(h, 1)] == 0).all()


def test_attend_keeps_its_contract():
    """attend: masks of any broadcastable rank, GQA head mapping, float64 in → float64 out."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 4, 3, 2))
    k = rng.normal(size=(1, 2, 5, 2))
    v = rng.normal(size=(1, 2, 5, 2))
    m2 = rng.random((3, 5)) < 0.6
    m2[0] = False
    out = np.asarray(attend(q, k, v, m2))
    full = np.asarray(attend(q, k, v, np.broadcast_to(m2, (1, 4, 3, 5))))
    assert out.dtype == np.float64
    assert np.abs(out - full).max() <= 1e-15
    assert (out[:, :, 0] == 0).all()
    per_head = np.asarray(attend(q[:, 2:4], k[:, 1:2], v[:, 1:2], m2))
    assert np.abs(out[:, 2:4] - per_head).max() <= 1e-15
    with pytest.raises(ValueError, match="multiple"):
        attend(q[:, :3], k, v, m2)


def test_blocked_rejects_bad_calls():
    rng = np.random.default_rng(1)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, 2, 4, 2, 3, 6, 4, np.float64, scenario="chunk", vision=False
    )
    with pytest.raises(ValueError, match="mode"):
        blocked(q, k, v, q_pos, kv_pos)
    with pytest.raises(ValueError, match="more blocks"):
        blocked(q, k, v, q_pos, kv_pos, mode="q", num_q_blocks=4)
    with pytest.raises(ValueError, match="batch_fold"):
        blocked(q, k[[0, 1, 0]], v[[0, 1, 0]], q_pos, kv_pos, mode="kv", num_kv_blocks=2,
                batch_fold=True)  # fmt: skip
    with pytest.raises(ValueError, match="ctx_len"):
        blocked(q, k, v, q_pos, kv_pos, mode="kv", num_kv_blocks=2, ctx_len=5)
    with pytest.raises(ValueError, match="together"):
        blocked(q, k, v, q_pos, kv_pos, mode="kv", num_kv_blocks=2, q_group=q_pos)
    with pytest.raises(ValueError, match=r"kv_pos has shape \(2, 5\); expected \(2, 6\)"):
        reference(q, k, v, q_pos, kv_pos[:, :5])
    with pytest.raises(ValueError, match="q_pos has shape"):
        blocked(q, k, v, q_pos[:1], kv_pos, mode="kv", num_kv_blocks=2)


def test_blocked_is_jittable_and_float32_softmax_for_bf16():
    """Block loops unroll under jit; bfloat16 inputs stay within bf16 rounding of float64."""
    import jax

    rng = np.random.default_rng(2)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, 1, 4, 2, 8, 16, 8, np.float64, scenario="chunk", vision=False
    )
    fn = jax.jit(lambda *a: blocked(*a, mode="qkv", num_q_blocks=2, num_kv_blocks=4))
    want = reference(q, k, v, q_pos, kv_pos)
    got = fn(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), q_pos, kv_pos)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) <= 3e-2
    assert rel_err(fn(q, k, v, q_pos, kv_pos), want) <= 1e-12


def dense_oracle(q, k, v, visible, *, scale=1.0, softcap=None):
    """float64 numpy attention, query by query: q [B, H, S, D], k, v [B, Hkv, T, D], visible
    [B, H, S, T] bool; query head i reads kv head i // (H / Hkv); no visible key → zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, h, s, _ = q.shape
    g = h // k.shape[1]
    out = np.zeros(q.shape)
    for row in range(b):
        for head in range(h):
            for i in range(s):
                seen = visible[row, head, i]
                if not seen.any():
                    continue
                logits = k[row, head // g, seen] @ q[row, head, i] * scale
                if softcap is not None:
                    logits = np.tanh(logits / softcap) * softcap
                p = np.exp(logits - logits.max())
                out[row, head, i] = (p / p.sum()) @ v[row, head // g, seen]
    return out


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attend_per_head_mask_scale_softcap_against_numpy(dtype):
    """A different mask per query head (grouped [B, Hkv, g] in the kernel), scale and softcap,
    a fully masked row; float32 computes in float32, float64 in float64."""
    rng = np.random.default_rng(5)
    q = rng.normal(size=(2, 6, 3, 4)).astype(dtype)
    k = rng.normal(size=(2, 2, 5, 4)).astype(dtype)
    v = rng.normal(size=(2, 2, 5, 4)).astype(dtype)
    visible = rng.random((2, 6, 3, 5)) < 0.5
    visible[:, :, :, 0] = True
    visible[1, 4, 2] = False
    for scale, softcap in ((1.0, None), (0.7, None), (0.7, 1.5)):
        got = np.asarray(attend(q, k, v, visible, scale=scale, softcap=softcap))
        assert got.dtype == dtype
        want = dense_oracle(q, k, v, visible, scale=scale, softcap=softcap)
        assert rel_err(got, want) <= {np.float64: 1e-13, np.float32: 2e-6}[dtype], (scale, softcap)
        assert (got[1, 4, 2] == 0).all()
    with pytest.raises(ValueError, match="query heads 5 must be a multiple of kv heads 2"):
        attend(q[:, :5], k, v, visible[:, :5])


def test_mask_exact():
    """Causal, padding on either side, vision runs both ways, the window bounding the past."""
    q_pos = np.array([[2, 3, -1], [0, 1, 2]])
    kv_pos = np.array([[0, 1, 2, 3, -1], [0, 1, 2, 3, 4]])
    runs_q = np.array([[1, 1, -1], [-1, 0, 0]])
    runs_kv = np.array([[-1, -1, 1, 1, -1], [-1, 0, 0, 0, -1]])
    got = np.asarray(mask(q_pos, kv_pos)).astype(int)
    assert got.shape == (2, 1, 3, 5)
    assert got[:, 0].tolist() == [
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]],
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],
    ]
    got = np.asarray(mask(q_pos, kv_pos, q_group=runs_q, kv_group=runs_kv, sliding_window=2))
    assert got[:, 0].astype(int).tolist() == [
        [[0, 1, 1, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]],
        [[1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [0, 1, 1, 1, 0]],
    ]
    # The window alone, W = 1: each query sees only itself.
    one = np.asarray(mask(q_pos[1:], kv_pos[1:], sliding_window=1))[0, 0].astype(int)
    assert one.tolist() == [[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 0, 0]]


# Every mode and option once, on one fixed problem (few shapes: fast enough to run per mutant
# in `make mutation`): the hypothesis sweep above covers random shapes and combinations.
SWEEP = [
    ("kv", dict(num_kv_blocks=3)),
    ("kv", dict(num_kv_blocks=4, skip_kv=True, ordered=True)),
    ("kv", dict(num_kv_blocks=2, headpar_split=3, skip_kv=True)),
    ("kv", dict(num_kv_blocks=2, headpar_split=0, num_cores=2, ctx_len=12)),
    ("kv", dict(num_kv_blocks=3, headpar_split=0, batch_fold=True, skip_kv=True)),
    ("q", dict(num_q_blocks=2, ordered=True)),
    ("h", dict(head_block_size=1)),
    ("h", dict(head_block_size=6, batch_fold=True)),
    ("qkv", dict(num_q_blocks=3, num_kv_blocks=2, skip_kv=True)),
    ("hq", dict(head_block_size=3, num_q_blocks=2)),
    ("hkv", dict(head_block_size=1, num_kv_blocks=3, batch_fold=True, ordered=True)),
    ("hqkv", dict(head_block_size=6, num_q_blocks=2, num_kv_blocks=2, headpar_split=2)),
    ("bhqkv", dict(num_batch_blocks=2, head_block_size=3, num_q_blocks=2, num_kv_blocks=2)),
    ("prefill_q", dict(prefill_block_chunks=2, prefill_n_rep_chunk=1)),
    ("prefill_kv", dict(num_kv_blocks=3, skip_kv=True, prefill_n_rep_chunk=3)),
    ("prefill_qkv", dict(prefill_block_chunks=2, num_kv_blocks=3, skip_kv=True)),
    ("prefill_online", dict(prefill_block_chunks=3, num_kv_blocks=2, skip_kv=True, ordered=True)),
    ("prefill_online", dict(prefill_block_chunks=2, num_kv_blocks=2, batch_fold=True)),
]


@pytest.mark.parametrize(
    ("mode", "opts"), SWEEP, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SWEEP)]
)
def test_blocked_sweep_equals_reference(mode, opts):
    """b 2, H 6, Hkv 2 (g 3), S 5, T 9: a ring cache with holes, vision runs, a sliding window
    and a softcap, so blocks with no visible key (skip_kv) and fully masked rows occur."""
    rng = np.random.default_rng(11)
    q, k, v, q_pos, kv_pos, groups = problem(
        rng, 2, 6, 2, 5, 9, 4, np.float64, scenario="ring", vision=True
    )
    q_pos[1, 3:] = -1
    extra = dict(sliding_window=4, softcap=3.0, scale=0.8, **groups)
    want = np.asarray(reference(q, k, v, q_pos, kv_pos, **extra))
    assert (want[1, :, 3:] == 0).all() and np.abs(want).max() > 0
    if opts.get("batch_fold"):
        k, v = fold(k), fold(v)
    got = np.asarray(jitted(blocked, q, k, v, q_pos, kv_pos, mode=mode, **opts, **extra))
    assert got.shape == want.shape and got.dtype == np.float64
    assert rel_err(got, want) <= 1e-12, (mode, opts)


@pytest.mark.parametrize(
    ("opts", "vision"),
    [
        (dict(mode="kv", num_kv_blocks=2, headpar_split=0, skip_kv=True), True),
        (dict(mode="q", num_q_blocks=2, ordered=True), False),
    ],
)
def test_blocked_over_every_device_of_this_process(opts, vision):
    """mesh=: heads split over all of this process's devices. `make test` has one CPU device
    (test_attention_sharded.py runs four in a subprocess); `make mutation` starts this process
    with four, so the split is real and mutmut sees the code it runs."""
    import jax
    from jax.sharding import Mesh

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("heads",))
    rng = np.random.default_rng(12)
    q, k, v, q_pos, kv_pos, groups = problem(
        rng, 2, 8, 4, 5, 9, 4, np.float64, scenario="chunk", vision=vision
    )
    extra = dict(sliding_window=5, softcap=4.0, scale=0.9, **groups)
    want = np.asarray(reference(q, k, v, q_pos, kv_pos, **extra))
    got = blocked(q, k, v, q_pos, kv_pos, mesh=mesh, **opts, **extra)
    assert len(got.sharding.device_set) == len(devices)
    assert got.shape == want.shape and got.dtype == np.float64
    assert rel_err(got, want) <= 1e-12
    with pytest.raises(ValueError) as err:
        blocked(
            q,
            fold(k),
            fold(v),
            q_pos,
            kv_pos,
            mesh=mesh,
            mode="kv",
            num_kv_blocks=2,
            batch_fold=True,
        )
    assert str(err.value) == "a mesh shards the heads of an unfolded cache; drop batch_fold"
    if len(devices) > 1:
        with pytest.raises(ValueError) as err:
            blocked(q[:, :6], k[:, :3], v[:, :3], q_pos, kv_pos, mesh=mesh, **opts)
        assert str(err.value) == (
            f"kv heads 3 must split evenly over the mesh's {len(devices)} devices"
        )


@pytest.mark.parametrize("late", [True, False])
@pytest.mark.parametrize(
    "opts",
    [
        dict(mode="kv", num_kv_blocks=4, skip_kv=True),
        dict(mode="kv", num_kv_blocks=4, skip_kv=True, ordered=True),
        dict(mode="kv", num_kv_blocks=2, headpar_split=4, skip_kv=True),
        dict(mode="kv", num_kv_blocks=1, headpar_split=2),
        dict(mode="prefill_online", prefill_block_chunks=2, num_kv_blocks=4, skip_kv=True),
    ],
)
def test_skipped_blocks_and_float32(opts, late):
    """Late queries under a short window (the first KV blocks are seen by no query: skip_kv
    keeps the empty state m = −inf, l = 0, O = 0) or early queries (the last blocks are in
    their future: skip_kv keeps the state so far). float32 in, float32 out (ordered adds a
    float32 zero, never a float64 one)."""
    rng = np.random.default_rng(13)
    q = rng.normal(size=(1, 2, 2, 4)).astype(np.float32)
    k = rng.normal(size=(1, 1, 8, 4)).astype(np.float32)
    v = rng.normal(size=(1, 1, 8, 4)).astype(np.float32)
    q_pos, kv_pos = np.array([[6, 7]] if late else [[0, 1]]), np.arange(8)[None]
    want = np.asarray(reference(q, k, v, q_pos, kv_pos, sliding_window=2))
    got = np.asarray(blocked(q, k, v, q_pos, kv_pos, sliding_window=2, **opts))
    assert got.dtype == np.float32
    assert rel_err(got, want) <= 2e-6


def test_rep_chunks_uneven_batch_blocks_config_and_call_errors():
    """Query-head chunks of 2 inside GQA groups of 4 (the chunks' concatenation axis matters
    only then), batch blocks of 2 rows and 1 row, `config=`, and the exact call errors."""
    from ref.blocking import BlockingConfig

    rng = np.random.default_rng(14)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, 3, 8, 2, 3, 6, 4, np.float64, scenario="chunk", vision=False
    )
    want = np.asarray(reference(q, k, v, q_pos, kv_pos))
    cases = [
        dict(mode="h", head_block_size=2),
        dict(mode="prefill_kv", num_kv_blocks=2, prefill_n_rep_chunk=2),
        dict(mode="bhqkv", num_batch_blocks=2, head_block_size=4, num_q_blocks=1, num_kv_blocks=1),
    ]
    for opts in cases:
        assert rel_err(jitted(blocked, q, k, v, q_pos, kv_pos, **opts), want) <= 1e-12, opts
    cfg = BlockingConfig(mode="qkv", num_q_blocks=2, num_kv_blocks=3)
    assert rel_err(jitted(blocked, q, k, v, q_pos, kv_pos, config=cfg), want) <= 1e-12
    errors = [
        (dict(), "blocked() needs mode=... (or config=BlockingConfig(...))"),
        (dict(config=cfg, mode="kv"), "give either config= or mode= with options, not both"),
        (dict(config=cfg, num_kv_blocks=2), "give either config= or mode= with options, not both"),
        (
            dict(mode="kv", num_kv_blocks=2, kv_group=kv_pos),
            "q_group and kv_group must be given together (vision run ids, -1 = text)",
        ),
    ]
    for kwargs, message in errors:
        with pytest.raises(ValueError) as err:
            blocked(q, k, v, q_pos, kv_pos, **kwargs)
        assert str(err.value) == message


def test_input_checks_name_the_bad_value():
    """Every refusal of `reference` and `blocked`, word for word: non-finite q/k/v and
    positions below −1 at their first index, each position/group array's shape, a k batch that
    is not q's, batch_fold's cache layout and rows, query heads not a multiple of kv heads."""
    rng = np.random.default_rng(15)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, 2, 4, 2, 3, 6, 4, np.float64, scenario="chunk", vision=False
    )
    q_group, kv_group = np.zeros_like(q_pos), np.zeros_like(kv_pos)
    opts = dict(mode="kv", num_kv_blocks=2)

    def spoil(x, index, value):
        x = np.array(x)
        x[index] = value
        return x

    shapes = "for q (2, 4, 3, 4) and k (2, 2, 6, 4)"
    finite, position = ": expected finite values", ": expected −1 (padding) or ≥ 0"
    cases = [
        ((spoil(q, (1, 2, 0, 3), np.nan), k, v, q_pos, kv_pos), {}, f"q[1, 2, 0, 3] = nan{finite}"),
        ((q, spoil(k, (0, 1, 5, 0), np.inf), v, q_pos, kv_pos), {}, f"k[0, 1, 5, 0] = inf{finite}"),
        (
            (q, k, spoil(v, (1, 0, 2, 2), -np.inf), q_pos, kv_pos),
            {},
            f"v[1, 0, 2, 2] = -inf{finite}",
        ),
        ((q, k, v, spoil(q_pos, (1, 2), -2), kv_pos), {}, f"q_pos[1, 2] = -2{position}"),
        ((q, k, v, q_pos, spoil(kv_pos, (0, 4), -3)), {}, f"kv_pos[0, 4] = -3{position}"),
        (
            (q, k, v, q_pos[:, :2], kv_pos),
            {},
            f"q_pos has shape (2, 2); expected (2, 3) {shapes}",
        ),
        (
            (q, k, v, q_pos, kv_pos[:1]),
            {},
            f"kv_pos has shape (1, 6); expected (2, 6) {shapes}",
        ),
        (
            (q, k, v, q_pos, kv_pos),
            dict(q_group=q_group[:, :1], kv_group=kv_group),
            f"q_group has shape (2, 1); expected (2, 3) {shapes}",
        ),
        (
            (q, k, v, q_pos, kv_pos),
            dict(q_group=q_group, kv_group=kv_group[:, None]),
            f"kv_group has shape (2, 1, 6); expected (2, 6) {shapes}",
        ),
    ]
    for args, extra, message in cases:
        for fn, kw in ((reference, {}), (blocked, opts)):
            with pytest.raises(ValueError) as err:
                fn(*args, **extra, **kw)
            assert str(err.value) == message, fn.__name__
    k1, v1 = k[:1], v[:1]
    with pytest.raises(ValueError) as err:
        blocked(q, k1, v1, q_pos, kv_pos, **opts)
    assert str(err.value) == "k batch 1 does not match q batch 2"
    with pytest.raises(ValueError) as err:
        reference(q, k1, v1, q_pos, kv_pos)
    assert str(err.value) == "k batch 1 does not match q batch 2"
    k3, v3 = np.concatenate([k, k[:1]]), np.concatenate([v, v[:1]])
    with pytest.raises(ValueError) as err:
        blocked(q, k3, v3, q_pos, kv_pos, batch_fold=True, **opts)
    assert str(err.value) == (
        "batch_fold expects a cache [1, B·Hkv, T, D] or [B, Hkv, T, D], got k (3, 2, 6, 4) "
        "for batch 2"
    )
    with pytest.raises(ValueError) as err:
        blocked(q, fold(k)[:, :3], fold(v)[:, :3], q_pos, kv_pos, batch_fold=True, **opts)
    assert str(err.value) == "batch_fold cache rows 3 are not a multiple of batch 2"
    got = blocked(q, fold(k), fold(v), q_pos, kv_pos, batch_fold=True, **opts)
    assert rel_err(got, reference(q, k, v, q_pos, kv_pos)) <= 1e-12
    # held unfolded, as a model's layers hold the cache: folded inside, the same answer
    unfolded = blocked(q, k, v, q_pos, kv_pos, batch_fold=True, **opts)
    assert rel_err(unfolded, reference(q, k, v, q_pos, kv_pos)) <= 1e-12
    with pytest.raises(ValueError) as err:
        blocked(q[:, :3], k, v, q_pos, kv_pos, **opts)
    assert str(err.value) == "query heads 3 must be a multiple of kv heads 2"
    with pytest.raises(ValueError) as err:
        blocked(q, k[:, :0], v[:, :0], q_pos, kv_pos, **opts)
    assert str(err.value) == "query heads 4 must be a multiple of kv heads 0"


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (pjit, shard_map, scan bodies)."""
    from jax.extend import core

    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, core.ClosedJaxpr):
                    yield from _eqns(item.jaxpr)
                elif isinstance(item, core.Jaxpr):
                    yield from _eqns(item)


def _dtypes(variables):
    return {np.dtype(v.aval.dtype).name for v in variables if hasattr(v.aval, "dtype")}


@pytest.mark.parametrize(
    "opts",
    [
        None,
        dict(mode="kv", num_kv_blocks=3),
        dict(mode="kv", num_kv_blocks=2, headpar_split=2),
        dict(mode="qkv", num_q_blocks=2, num_kv_blocks=3),
    ],
)
def test_precision_is_the_inputs(opts):
    """A kernel's reference computes in its inputs' precision: float32 q/k/v → no float64
    value anywhere (even with float64 enabled, as in these tests), so golden vectors' out_f32
    carries float32 error; bfloat16 → bfloat16 matmuls, float32 softmax, bfloat16 out."""
    import jax

    rng = np.random.default_rng(16)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, 2, 4, 2, 4, 9, 8, np.float64, scenario="chunk", vision=False
    )

    def run(q, k, v):
        extra = dict(scale=0.5, softcap=3.0, sliding_window=4)
        if opts is None:
            return reference(q, k, v, q_pos, kv_pos, **extra)
        return blocked(q, k, v, q_pos, kv_pos, **opts, **extra)

    for dtype, matmul in ((jnp.float32, "float32"), (jnp.bfloat16, "bfloat16")):
        closed = jax.make_jaxpr(run)(*(jnp.asarray(x, dtype) for x in (q, k, v)))
        eqns = list(_eqns(closed.jaxpr))
        floats = {d for e in eqns for d in _dtypes(e.outvars) if "float" in d}
        assert floats == {"float32", matmul}, dtype
        dots = [e for e in eqns if e.primitive.name == "dot_general"]
        assert dots and all(_dtypes(e.invars) == {matmul} for e in dots), dtype
        exps = [e for e in eqns if e.primitive.name == "exp"]
        assert exps and all(_dtypes(e.invars) == {"float32"} for e in exps), dtype
        assert closed.out_avals[0].dtype == dtype


def test_online_softmax_survives_logits_past_exp_range():
    """float32 scores spanning about ±300 across KV blocks: every update must shift by the
    running maximum of the scores (exp overflows float32 past 88), so the blocked result equals
    a float64 numpy softmax; also attend's default scale is 1 and a per-head mask works for one
    query (decode) and for two query heads over one kv head."""
    rng = np.random.default_rng(17)
    q, k, v, q_pos, kv_pos, _ = problem(
        rng, 2, 4, 2, 5, 12, 4, np.float64, scenario="chunk", vision=False
    )
    q32, k32, v32 = (np.asarray(x, np.float32) for x in (q * 60, k, v))
    visible = np.asarray(mask(q_pos, kv_pos))[:, :, :, :].repeat(4, axis=1)
    want = dense_oracle(q32, k32, v32, visible)
    assert np.abs(want).max() > 0
    for opts in (
        dict(mode="kv", num_kv_blocks=4),
        dict(mode="kv", num_kv_blocks=4, headpar_split=2),
        dict(mode="prefill_online", prefill_block_chunks=1, num_kv_blocks=3),
    ):
        got = np.asarray(jitted(blocked, q32, k32, v32, q_pos, kv_pos, **opts))
        assert np.isfinite(got).all() and rel_err(got, want) <= 2e-6, opts
    got = np.asarray(jitted(attend, q, k, v, visible))
    assert rel_err(got, dense_oracle(q, k, v, visible)) <= 1e-13
    for h, hkv, s in ((6, 2, 1), (2, 1, 3)):
        qh = rng.normal(size=(2, h, s, 4))
        kh, vh = rng.normal(size=(2, 2, hkv, 7, 4))
        seen = rng.random((2, h, s, 7)) < 0.6
        got = np.asarray(jitted(attend, qh, kh, vh, seen, scale=0.8))
        assert rel_err(got, dense_oracle(qh, kh, vh, seen, scale=0.8)) <= 1e-13, (h, hkv, s)


def test_mask_refuses_one_group_alone():
    """mask() itself (not only blocked) refuses q_group without kv_group, word for word."""
    pos = np.arange(4)[None]
    for kwargs in (dict(q_group=pos), dict(kv_group=pos)):
        with pytest.raises(ValueError) as err:
            mask(pos, pos, **kwargs)
        assert str(err.value) == (
            "q_group and kv_group must be given together (vision run ids, -1 = text)"
        )


@st.composite
def prefill_cases(draw):
    """A prefill mode on shapes where a tile spans several kv heads (Hkv 2–4) and, with a GQA
    group of 2 or 4, maybe several n_rep chunks; batch fold, ordered, skip_kv, headpar pieces."""
    hkv, g = draw(st.integers(2, 4)), draw(st.sampled_from([1, 2, 4]))
    b, s, t = draw(st.integers(1, 2)), draw(st.sampled_from([1, 5])), draw(st.sampled_from([6, 9]))
    mode = draw(st.sampled_from(["prefill_q", "prefill_kv", "prefill_qkv", "prefill_online"]))
    opts = dict(mode=mode, prefill_n_rep_chunk=draw(st.sampled_from([1, g])))
    if mode != "prefill_kv":
        opts["prefill_block_chunks"] = draw(st.integers(1, s))
    if mode != "prefill_q":
        opts["num_kv_blocks"] = draw(st.integers(1, 4))
        opts["skip_kv"] = draw(st.booleans())
        if draw(st.booleans()):
            opts["headpar_split"] = draw(st.integers(1, 3))
    opts["batch_fold"] = draw(st.booleans())
    opts["ordered"] = draw(st.booleans())
    return dict(b=b, h=hkv * g, hkv=hkv, s=s, t=t, d=4), opts


@settings(max_examples=examples(7))
@given(prefill_cases(), st.booleans(), st.integers(0, 2**32 - 1))
def test_prefill_heads_together_equal_the_plans_head_by_head_schedule(case, vision, seed):
    """Prefill modes run every kv head of a tile in one matmul (`_executed_heads`, as
    QEfficient's prefill kernels do) where `Plan.heads` — the schedule the kernel kit
    publishes — lists one kv head per block: the batched path equals that plan run head by head
    and the dense reference (float64, 1e-12)."""
    from ref.attention.blocks import _blocked, _executed_heads
    from ref.blocking import BlockingConfig

    shapes, opts = case
    rng = np.random.default_rng(seed)
    q, k, v, q_pos, kv_pos, groups = problem(
        rng, **shapes, dtype=np.float64, scenario="ring", vision=vision
    )
    extra = dict(sliding_window=4, softcap=3.0, scale=0.8)
    want = np.asarray(jitted(reference, q, k, v, q_pos, kv_pos, **groups, **extra))
    config = BlockingConfig(**opts)
    b, h, hkv, s, t = (shapes[n] for n in ("b", "h", "hkv", "s", "t"))
    plan = config.plan(b, h, hkv, s, t)
    rows = b * hkv if config.batch_fold else hkv
    assert [(k0, k1) for k0, k1, _ in plan.heads] == [(j, j + 1) for j in range(rows)]
    assert [(k0, k1) for k0, k1, _ in _executed_heads(plan, True)] == [(0, rows)]
    if config.batch_fold:
        k, v = fold(k), fold(v)
    args = (q, k, v, q_pos, kv_pos, groups.get("q_group"), groups.get("kv_group"))
    together = np.asarray(jitted(_blocked, *args, plan=plan, heads_together=True, **extra))
    apart = np.asarray(jitted(_blocked, *args, plan=plan, heads_together=False, **extra))
    assert rel_err(together, apart) <= 1e-12, opts
    assert rel_err(together, want) <= 1e-12, opts


# (options, sliding window): a window of 4 (a whole number of the 2-key blocks at K = 8) and of
# 5 (ending inside a block), each on some of the modes; one export and three calls per example.
SYMBOLIC_MODES = [
    (dict(mode="kv", num_kv_blocks=4), 4),
    (dict(mode="kv", num_kv_blocks=2, headpar_split=4, skip_kv=True), 5),
    (dict(mode="hqkv", head_block_size=2, num_q_blocks=2, num_kv_blocks=4), 4),
    (dict(mode="prefill_qkv", prefill_block_chunks=2, num_kv_blocks=4), 5),
    (dict(mode="kv", num_kv_blocks=4, batch_fold=True), 5),
]


@pytest.mark.parametrize(
    ("options", "window"), SYMBOLIC_MODES, ids=[o["mode"] for o, _ in SYMBOLIC_MODES]
)
@settings(max_examples=examples(1), deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_blocked_over_a_symbolic_key_length_equals_reference(options, window, seed):
    """`blocked` traced once with a symbolic key length K (jax.export, K a multiple of 8: exact
    blocks and head-parallel pieces) and called at K = 8, 16, 32 equals `reference` on the same
    keys cut to K (float32, 1e-5; the export runs what an ONNX graph of a CCL runs)."""
    import jax
    from jax import export as jax_export
    from jax import lax

    rng = np.random.default_rng(seed)
    b, h, hkv, s, d, t = 2, 4, 2, 4, 8, 32
    q = rng.standard_normal((b, h, s, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, hkv, t, d), dtype=np.float32) for _ in range(2))
    q_pos = np.stack([np.arange(s) + 3, np.arange(s) + 1]).astype(np.int32)
    kv_pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))

    def cut(kk, vv, kp, ccl):
        n = ccl.shape[0]
        return tuple(lax.slice_in_dim(x, 0, n, axis=a) for x, a in ((kk, 2), (vv, 2), (kp, 1)))

    def fn(qq, kk, vv, qp, kp, ccl):
        kk, vv, kp = cut(kk, vv, kp, ccl)
        return blocked(qq, kk, vv, qp, kp, sliding_window=window, **options)

    (n,) = jax_export.symbolic_shape("n", constraints=("n <= 32", "n >= 8", "mod(n, 8) == 0"))
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, q_pos, kv_pos)]
    exported = jax_export.export(jax.jit(fn))(*shapes, jax.ShapeDtypeStruct((n,), np.int32))
    for ccl in (8, 16, 32):
        feed = (q, k, v, q_pos, kv_pos, np.zeros(ccl, np.int32))
        kk, vv, kp = cut(k, v, kv_pos, feed[-1])
        want = jitted(reference, q, kk, vv, q_pos, kp, sliding_window=window)
        assert rel_err(exported.call(*feed), want) < 1e-5, (options, ccl)
