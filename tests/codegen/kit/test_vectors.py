"""Golden vectors (`python -m codegen vectors`): every op's out_f64 against an independent
numpy float64 implementation written here (attention decides visibility key by key from
positions, groups and window — not ref's mask), out_f32 within float32 tolerance, the JSON's
stated errors, byte-identical reruns through the recorded command, and one-line errors."""

import json
import math
import shlex

import ml_dtypes
import numpy as np
import pytest

from codegen.__main__ import main
from codegen.kit import vector_options, vectors
from ref.attention import reference
from ref.blocking import mode as blocking_mode
from ref.gemma4 import moe
from tests.visibility import visible_numpy
from weights import read_header


def attention_numpy(q, k, v, visible, scale=1.0, softcap=None):
    """Softmax attention row by row in float64: q [B, H, S, D], k, v [B, Hkv, T, D],
    visible [B, S, T] → [B, H, S, D]; a row that sees nothing is 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, h, s, _ = q.shape
    g = h // k.shape[1]
    out = np.zeros_like(q)
    for i in range(b):
        for n in range(h):
            for j in range(s):
                keys = np.flatnonzero(visible[i, j])
                if not len(keys):
                    continue
                x = scale * (k[i, n // g, keys] @ q[i, n, j])
                if softcap is not None:
                    x = softcap * np.tanh(x / softcap)
                p = np.exp(x - x.max())
                out[i, n, j] = p @ v[i, n // g, keys] / p.sum()
    return out


def unfolded(t, meta):
    """k or v back to [B, Hkv, T, D] when the vectors hold a folded cache."""
    if meta["options"].get("batch_fold"):
        return t.reshape(meta["options"]["batch"], -1, *t.shape[2:])
    return t


# One case per mode family, the options spread over them (that every mode equals `reference` is
# ref's own test_blocking.py/test_attention.py; these check what the vectors add: positions,
# groups, layouts, options, precisions).
ATTENTION_CASES = [
    ("dense", {"sliding_window": "3", "vision": "2"}),
    ("kv", {"headpar_split": "2", "num_kv_blocks": "3", "scale": "0.25"}),
    ("hqkv", {"skip_kv": "true", "q_start": "1", "softcap": "2.5", "ctx_len": "12"}),
    ("bhqkv", {"num_batch_blocks": "2"}),
    ("kv", {"batch_fold": "true", "skip_kv": "true", "q_start": "0"}),
    ("prefill_qkv", {"headpar_split": "2", "skip_kv": "true", "sliding_window": "3"}),
    ("prefill_online", {"prefill_n_rep_chunk": "1", "vision": "3", "ordered": "true"}),
]


# Small sizes keep the unrolled block loops (and so the compile time) short; GQA g = 2.
SMALL = {"batch": "2", "heads": "4", "kv_heads": "2", "seq": "4", "ctx": "8", "head_dim": "4"}


@pytest.mark.parametrize("mode, given", ATTENTION_CASES, ids=lambda x: str(x))
def test_attention_vectors_equal_numpy_and_ref(mode, given):
    t, meta = vectors.generate("attention", mode, SMALL | given, seed=3)
    o = meta["options"]
    groups = (t.get("q_group"), t.get("kv_group"))
    visible = visible_numpy(t["q_pos"], t["kv_pos"], *groups, o["sliding_window"])
    k, v = unfolded(t["k"], meta), unfolded(t["v"], meta)
    want = attention_numpy(t["q"], k, v, visible, o["scale"], o["softcap"])
    assert t["out_f64"].dtype == np.float64 and t["out_f32"].dtype == np.float32
    assert np.abs(t["out_f64"] - want).max() <= 1e-12
    dense = reference(
        t["q"].astype(np.float64),
        k.astype(np.float64),
        v.astype(np.float64),
        t["q_pos"],
        t["kv_pos"],
        sliding_window=o["sliding_window"],
        q_group=groups[0],
        kv_group=groups[1],
        scale=o["scale"],
        softcap=o["softcap"],
    )
    assert np.abs(t["out_f64"] - np.asarray(dense)).max() <= 1e-12
    err = np.abs(t["out_f32"].astype(np.float64) - want).max()
    assert err <= 2e-6 * max(1.0, np.abs(want).max())
    tol = meta["tolerance"]["float32"]
    assert tol["ref_error"] == float(np.abs(t["out_f32"] - t["out_f64"]).max())
    assert tol["bound"] == 2 * tol["ref_error"] + tol["floor"]
    assert meta["mode"] == mode and meta["seed"] == 3
    for name, info in meta["inputs"].items():
        assert list(t[name].shape) == info["shape"] and str(t[name].dtype) == info["dtype"]


@pytest.mark.parametrize("mode", [m for m in vector_options.ATTENTION_MODES if m != "dense"])
def test_every_mode_resolves_to_a_ref_config_with_its_default_blocks(mode):
    resolved, options = vector_options.resolve("attention", mode, {"seq": "4", "ctx": "8"})
    config = vector_options.blocking_config(resolved, options)
    blocking = {k: v for k, v in options.items() if k in vector_options.BLOCKING_OPTIONS}
    assert config.mode == mode and blocking == blocking_mode(mode).defaults
    assert config.plan(2, 4, 2, 4, 8).q


def test_padding_rows_and_empty_slots():
    t, _ = vectors.generate("attention", "dense", SMALL | {"q_start": "0"})
    assert t["q_pos"].tolist() == [[0, 1, 2, 3], [-1, 0, 1, 2]]
    assert t["kv_pos"].tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1, -1, -1]]
    assert (t["out_f64"][1, :, 0] == 0).all() and np.abs(t["out_f64"][0, :, 0]).min() > 0


def test_low_precision_inputs_hold_the_same_values_and_errors_are_stated():
    t, meta = vectors.generate("attention", "qkv", seed=1, low=("float16", "bfloat16"))
    for name in ("q", "k", "v"):
        assert t[f"{name}_f16"].dtype == np.float16
        assert t[f"{name}_bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
        assert (t[f"{name}_f16"].astype(np.float32) == t[name]).all()
        assert (t[f"{name}_bf16"].astype(np.float32) == t[name]).all()
    for precision, suffix, eps in (("float16", "f16", 2**-10), ("bfloat16", "bf16", 2**-7)):
        tol = meta["tolerance"][precision]
        err = np.abs(t[f"out_{suffix}"].astype(np.float64) - t["out_f64"]).max()
        assert tol["ref_error"] == float(err) and 0 < err < 30 * eps
        assert tol["floor"] == eps * max(1.0, float(np.abs(t["out_f64"]).max()))
    assert "--fp16 --bf16" in meta["command"]


def test_cache_update_vectors_equal_numpy():
    t, meta = vectors.generate("cache_update", given={"empty": "2", "seq": "5"}, seed=2)
    want_k, want_v = t["cache_k"].astype(np.float64), t["cache_v"].astype(np.float64)
    for b in range(t["slots"].shape[0]):
        for i, slot in enumerate(t["slots"][b]):
            if slot >= 0:
                want_k[b, :, slot] = t["k_new"][b, :, i]
                want_v[b, :, slot] = t["v_new"][b, :, i]
    assert (t["slots"] == -1).sum(1).tolist() == [2, 2]
    assert (t["out_f64"] == np.stack([want_k, want_v])).all()
    assert (t["out_f32"] == t["out_f64"]).all()
    assert meta["tolerance"]["float32"]["ref_error"] == 0.0


def item_blocks(grids, k=3):
    """Pooling blocks of row-major items, as index lists (oracle for pool_index)."""
    rows, offset = [], 0
    for h, w in grids:
        for ty in range(h // k):
            for tx in range(w // k):
                rows.append(
                    [offset + (ty * k + dy) * w + tx * k + dx for dy in range(k) for dx in range(k)]
                )
        offset += h * w
    return rows


def test_pool_vectors_equal_numpy():
    t, meta = vectors.generate("pool", given={"grids": "3x6,6x3", "hidden": "5"}, seed=4)
    blocks = item_blocks([(3, 6), (6, 3)])
    assert t["pool_index"].tolist() == blocks
    scale = math.sqrt(5)
    assert meta["scalars"]["scale"] == float(np.float32(scale))
    x = t["x"].astype(np.float64)
    want = np.stack([x[b].mean(0) for b in blocks]) * meta["scalars"]["scale"]
    assert np.abs(t["out_f64"] - want).max() <= 1e-13
    assert np.abs(t["out_f32"] - want).max() <= 1e-6


def test_rope2d_vectors_equal_numpy():
    t, meta = vectors.generate("rope2d", given={"grids": "2x5", "head_dim": "12"}, seed=5)
    pos = np.array([(x, y) for y in range(2) for x in range(5)])
    assert (t["positions"] == pos).all()
    x = t["x"].astype(np.float64)
    half, quarter = 6, 3
    # Gemma 4 (and HF) form angles in float32: inv_freq and positions are float32.
    inv = (1.0 / 100.0 ** (np.arange(0, half, 2, dtype=np.float32) / half)).astype(np.float32)
    want = np.empty_like(x)
    for axis in (0, 1):
        part = x[..., axis * half : (axis + 1) * half]
        angle = (pos[:, axis, None].astype(np.float32) * inv).astype(np.float64)[:, None]
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = part[..., :quarter], part[..., quarter:]
        want[..., axis * half : axis * half + quarter] = a * cos - b * sin
        want[..., axis * half + quarter : (axis + 1) * half] = b * cos + a * sin
    # ref takes cos/sin of the float32 angles in float32 (1 ulp ≈ 6e-8 apart from numpy's).
    assert np.abs(t["out_f64"] - want).max() <= 1e-6
    assert np.abs(t["out_f32"] - want).max() <= 2e-6
    assert meta["tolerance"]["float32"]["bound"] > 0


def test_vision_attention_vectors_equal_numpy():
    given = {"grids": "3x3,3x6", "budget": "4", "varlen": "true"}
    t, _ = vectors.generate("vision_attention", given=given, seed=6)
    seg = np.array([0] * 9 + [1] * 18 + [-1] * 9)
    assert (t["segment_ids"] == seg).all() and t["cu_seqlens"].tolist() == [0, 9, 27]
    q, k, v = (t[n].astype(np.float64) for n in "qkv")
    g = q.shape[1] // k.shape[1]
    want = np.zeros_like(q)
    for i in np.flatnonzero(seg >= 0):
        keys = np.flatnonzero(seg == seg[i])
        for n in range(q.shape[1]):
            x = k[keys, n // g] @ q[i, n]
            p = np.exp(x - x.max())
            want[i, n] = p @ v[keys, n // g] / p.sum()
    assert np.abs(t["out_f64"] - want).max() <= 1e-12
    assert np.abs(t["out_f32"] - want).max() <= 2e-6 * max(1.0, np.abs(want).max())


def test_cli_writes_files_that_the_recorded_command_rewrites_byte_for_byte(tmp_path, capsys):
    out = tmp_path / "v"
    args = ["vectors", "--op", "attention", "--mode", "hkv", "--opt", "sliding_window=3"]
    assert main([*args, "--seq", "4", "--out", str(out), "--seed", "7", "--fp16"]) == 0
    assert "wrote" in capsys.readouterr().out
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"vectors.safetensors", "vectors.json"}
    meta = json.loads(first["vectors.json"])
    assert meta["options"]["seq"] == 4 and meta["seed"] == 7
    words = shlex.split(meta["command"])
    assert words[:3] == ["python", "-m", "codegen"]
    assert main(words[3:]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    names = set(read_header(out / "vectors.safetensors"))
    inputs = {"q", "k", "v", "q_pos", "kv_pos", "q_f16", "k_f16", "v_f16"}
    assert inputs | {"out_f64", "out_f32", "out_f16"} == names
    assert set(meta["inputs"]) | set(meta["outputs"]) == names


def moe_numpy(x, gate_up, down, weights, index):
    """Each token's picks one by one in float64: x [T, D], gate_up [E, 2I, D], down [E, D, I],
    weights, index [T, K] → [T, D] (gelu_tanh written out)."""
    x, gate_up, down, weights = (np.asarray(a, np.float64) for a in (x, gate_up, down, weights))
    inter = down.shape[2]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], index[t], strict=True):
            h = gate_up[e] @ x[t]
            g, u = h[:inter], h[inter:]
            gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
            out[t] += w * (down[e] @ (gelu * u))
    return out


@pytest.mark.parametrize(
    "mode, given",
    [
        ("dense", {}),
        ("gather", {"top_k": "3", "experts": "5"}),
        ("nsp", {"hot": "6"}),  # expert 0 holds 6 tokens: past its first chunk of 4
        ("nsp", {"experts": "6", "num_nsp": "3", "packed_chunk": "8"}),
    ],
    ids=str,
)
def test_moe_vectors_equal_numpy_and_ref_dense(mode, given):
    t, meta = vectors.generate("moe", mode, given, seed=8, low=("bfloat16",))
    args = [t[n] for n in ("x", "gate_up", "down", "weights", "index")]
    want = moe_numpy(*args)
    assert np.abs(t["out_f64"] - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
    dense = moe.dense(*(np.asarray(a, np.float64) for a in args[:4]), args[4])
    assert np.abs(t["out_f64"] - np.asarray(dense)).max() <= 1e-12 * max(1.0, np.abs(want).max())
    o = meta["options"]
    e, k = o["experts"], o["top_k"]
    picks = t["index"]
    assert picks.shape == (o["tokens"], k) and ((picks >= 0) & (picks < e)).all()
    assert all(len(set(row)) == k for row in picks.tolist())
    assert np.allclose(t["weights"].sum(1), 1, atol=2e-2) and (t["weights"] > 0).all()
    assert (picks[: o["hot"], 0] == 0).all()
    assert meta["routed_per_expert"] == np.bincount(picks.ravel(), minlength=e).tolist()
    assert meta["mode"] == mode and meta["moe_mode"] == str(vector_options.moe_mode(mode, o))
    err = np.abs(t["out_f32"].astype(np.float64) - want).max()
    assert err <= 2e-6 * max(1.0, np.abs(want).max())
    bf16 = meta["tolerance"]["bfloat16"]
    assert 0 < bf16["ref_error"] <= bf16["bound"]


def test_moe_vectors_reproduce_through_the_recorded_command(tmp_path):
    out = tmp_path / "moe"
    args = ["vectors", "--op", "moe", "--mode", "nsp", "--opt", "hot=5", "--out", str(out)]
    assert main([*args, "--seed", "2", "--fp16"]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    meta = json.loads(first["vectors.json"])
    assert "--opt num_nsp=2 --opt packed_chunk=4" in meta["command"]
    assert main(shlex.split(meta["command"])[3:]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    names = set(read_header(out / "vectors.safetensors"))
    floats = {"x", "gate_up", "down", "weights"}
    outputs = {"out_f64", "out_f32", "out_f16"}
    assert names == floats | {f"{n}_f16" for n in floats} | {"index"} | outputs


@pytest.mark.parametrize(
    "args, message",
    [
        (["--op", "moe", "--mode", "loop"], "unknown moe mode 'loop'; expected one of dense"),
        (["--op", "moe", "--opt", "num_nsp=2"], "num_nsp=2 is not used by mode 'dense'"),
        (["--op", "moe", "--mode", "nsp", "--opt", "num_nsp=3"], "num_nsp=3 does not divide"),
        (["--op", "moe", "--mode", "nsp", "--opt", "packed_chunk=3"], "packed_chunk=3 does not"),
        (["--op", "moe", "--opt", "top_k=5"], "top_k=5 is more than the experts=4"),
        (["--op", "moe", "--opt", "hot=9"], "hot=9 is more than the tokens=8"),
        (["--op", "moe", "--opt", "window=2"], "unknown option 'window' for --op moe"),
        (["--mode", "qkv", "--opt", "num_q_blocks=0"], "num_q_blocks must be an int >= 1, got 0"),
        (["--mode", "kv", "--opt", "head_block_size=2"], "head_block_size=2 is not used by mode"),
        (["--mode", "fast"], "unknown attention mode 'fast'"),
        (["--opt", "num_kv_blocks=2"], "num_kv_blocks=2 is not used by mode 'dense'"),
        (["--opt", "colour=2"], "unknown option 'colour' for --op attention"),
        (["--opt", "seq=eight"], "option seq='eight': expected an integer"),
        (["--opt", "seq"], "--opt 'seq': expected key=value"),
        (["--mode", "q", "--opt", "num_q_blocks=9"], "num_q_blocks=9 is more blocks than the 8"),
        (["--opt", "q_start=12"], "q_start=12 with seq=8 runs past the cache of ctx=16 slots"),
        (["--heads", "3"], "heads=3 must be a multiple of kv_heads=2"),
        (["--opt", "vision=8"], "vision=8 at vision_offset=1 does not fit the 8 queries"),
        (["--op", "pool", "--mode", "kv"], "--mode 'kv' is only for --op attention"),
        (["--op", "pool", "--opt", "grids=4x4"], "multiples of the pooling kernel 3"),
        (["--op", "rope2d", "--opt", "head_dim=6"], "axial RoPE needs head_dim divisible by 4"),
        (["--op", "cache_update", "--opt", "empty=5"], "empty=5 is more than the seq=4 slots"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, message):
    assert main(["vectors", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
