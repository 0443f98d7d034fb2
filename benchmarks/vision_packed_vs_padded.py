"""Packed JAX vision tower vs transformers, padded and per image, against the FLOP floor.

The E2B-size tower (768 hidden, 12 heads × 64, FFN 3072, clipped linears) on a mixed batch of
items with 70, 140, 280 and 1120 soft tokens, the same random weights everywhere:

- HF padded: transformers pads every item to the largest budget (1120·9 = 10080 patches, as
  HF's processor does) and runs them as one batch (sdpa attention);
- HF per image: transformers runs each item alone, unpadded (sdpa), one after another;
- packed: our tower runs the 14490 real patches as one sequence, attention per item (jit;
  the first call's compile time is reported apart);
- FLOP floor: the packed (= unpadded) FLOPs at this machine's fp32 matmul rate, measured in
  the same run as the faster of `torch.matmul` and `jnp.matmul` on 4096² matrices.

Each round times the three runs back to back, so the ratios compare like with like on a
machine whose load varies; the table gives the median and the range over rounds. Then a
per-op profile of the packed run: each part of one layer jit-compiled alone on the same
shapes and weights, times the layer count. Usage:

    python benchmarks/vision_packed_vs_padded.py [--layers 2] [--threads 2] [--rounds 3]

The per-layer cost is the same in every layer, so fewer layers keep the ratios and cut the
wall time; the table says how many layers ran.
"""

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel  # noqa: E402

from ref.gemma4 import VisionTower  # noqa: E402
from ref.gemma4.config import VisionConfig  # noqa: E402
from ref.gemma4.vision import packed_attention, patch_embed, pool  # noqa: E402
from ref.layers import clipped_linear, gated_mlp, rms_norm  # noqa: E402
from ref.rope import axial_rope  # noqa: E402
from tests.hf_vision import hf_padded_inputs, hf_vision_config, randomize_, tree_of  # noqa: E402

# (h, w) patch grids of 70, 140, 280 and 1120 soft tokens (3×3 patches per soft token).
GRIDS = [(21, 30), (30, 42), (42, 60), (84, 120)]
BUDGET_TOKENS = 1120
GOALS = {"padded": 3.0, "per_image": 1.3, "floor": 1.5}


def layer_flops(cfg, lengths):
    """(linear, attention) FLOPs of one encoder layer over items of the given patch lengths."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qo = 2 * d * cfg.num_attention_heads * hd
    kv = 2 * d * cfg.num_key_value_heads * hd
    mlp = 3 * d * cfg.intermediate_size
    per_token = 2 * (qo + kv + mlp)
    attn = sum(4 * n * n * cfg.num_attention_heads * hd for n in lengths)
    return per_token * sum(lengths), attn


def seconds(fn, repeats=1):
    """Best wall time of `fn()` (which must block until its result is ready)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(size=4096):
    """(GFLOP/s, which) of the faster fp32 matmul: torch.matmul or jnp.matmul, size² × size²."""
    a = torch.rand(size, size)
    b = torch.rand(size, size)
    torch_s = seconds(lambda: torch.matmul(a, b), 3)
    ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    mm = jax.jit(jnp.matmul)
    mm(ja, jb).block_until_ready()
    jax_s = seconds(lambda: mm(ja, jb).block_until_ready(), 3)
    flop = 2 * size**3
    return max((flop / torch_s / 1e9, "torch.matmul"), (flop / jax_s / 1e9, "jnp.matmul"))


def run_padded(model, patches, grids):
    """(seconds, last_hidden_state [B·M, D]) of HF's padded batch."""
    values, pos = hf_padded_inputs(
        patches, grids, pad_tokens=BUDGET_TOKENS - max(h * w for h, w in grids) // 9
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(pixel_values=values, pixel_position_ids=pos).last_hidden_state
    return time.perf_counter() - t0, out.numpy()


def run_per_image(model, patches, grids):
    """(seconds, soft tokens [M, D]) of HF run on each item alone, unpadded."""
    total, outs = 0.0, []
    for p, g in zip(patches, grids, strict=True):
        values, pos = hf_padded_inputs([p], [g])
        t0 = time.perf_counter()
        with torch.no_grad():
            outs.append(model(pixel_values=values, pixel_position_ids=pos).last_hidden_state)
        total += time.perf_counter() - t0
    return total, torch.cat([o.reshape(-1, o.shape[-1]) for o in outs]).numpy()


def run_packed(tower, patches, grids):
    """(seconds, soft tokens [M, D]) of the packed tower."""
    t0 = time.perf_counter()
    _, out = tower.run(patches, grids)
    pooled = np.asarray(jax.block_until_ready(out["pooled"]))
    return time.perf_counter() - t0, pooled


def _bounds(p):
    return tuple(p[n] for n in ("input_min", "input_max", "output_min", "output_max"))


def _proj(p, x):
    return clipped_linear(x, p["linear"]["weight"], _bounds(p))


def profile_parts(cfg, params, packing, patches):
    """Per-op parts of the packed run: name → (jitted fn, args, how many times per tower)."""
    layer = params["encoder"]["layers"]["0"]
    att, mlp = layer["self_attn"], layer["mlp"]
    n, hd, eps = packing.positions.shape[0], cfg.head_dim, cfg.rms_norm_eps
    h, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((n, cfg.hidden_size)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((n, h, hd)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((n, hkv, hd)), jnp.float32)
    positions, segments = jnp.asarray(packing.positions), jnp.asarray(packing.segment_ids)
    cu = packing.cu_seqlens_static
    sandwich = [layer[k]["weight"] for k in layer if k.endswith("layernorm")]

    def projections(x):
        qkv = [_proj(att[k], x) for k in ("q_proj", "k_proj", "v_proj")]
        return qkv, _proj(att["o_proj"], qkv[0])

    def norms(x, q, k, v):
        outs = [rms_norm(x, w, eps) for w in sandwich]
        return (
            outs,
            rms_norm(q, att["q_norm"]["weight"], eps),
            rms_norm(k, att["k_norm"]["weight"], eps),
            rms_norm(v, None, eps),
        )

    def rope(q, k):
        return axial_rope(q, positions, cfg.rope_theta), axial_rope(k, positions, cfg.rope_theta)

    def attention(q, k, v):
        return packed_attention(q, k, v, segments, cu)

    def mlp_part(x):
        return gated_mlp(
            x, *(lambda y, k=k: _proj(mlp[k], y) for k in ("gate_proj", "up_proj", "down_proj"))
        )

    def embed_pool(flat, x):
        emb = patch_embed(
            flat,
            positions,
            params["patch_embedder"]["input_proj"]["weight"],
            params["patch_embedder"]["position_embedding_table"],
        )
        return emb, pool(x, jnp.asarray(packing.pool_index), cfg.hidden_size**0.5)

    layers = cfg.num_hidden_layers
    return {
        "attention (per item)": (attention, (q, kv, kv), layers),
        "q/k/v/o projections": (projections, (x,), layers),
        "MLP (gate, up, down, GELU)": (mlp_part, (x,), layers),
        "RMSNorms (4 + q/k/v)": (norms, (x, q, kv, kv), layers),
        "axial RoPE (q, k)": (rope, (q, kv), layers),
        "patch embed + pooling": (embed_pool, (jnp.asarray(patches), x), 1),
    }


def _ready(fn, args):
    return jax.block_until_ready(fn(*args))


def profile(cfg, params, packing, patches):
    """[(part, seconds per tower)] for each part, jitted alone, best of 2 after a warm-up."""
    rows = []
    for name, (fn, args, times) in profile_parts(cfg, params, packing, patches).items():
        once = partial(_ready, jax.jit(fn), args)
        once()
        rows.append((name, times * seconds(once, 2)))
    return rows


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def spread(values, fmt):
    """'median [min … max]' of a list of numbers."""
    median, low, high = (fmt.format(f(values)) for f in (statistics.median, min, max))
    return f"{median} [{low}…{high}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="encoder layers (E2B: 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = VisionConfig(num_hidden_layers=args.layers, use_clipped_linears=True)
    hf_cfg = hf_vision_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = randomize_(Gemma4VisionModel(hf_cfg).eval(), seed=0)
    tower = VisionTower(cfg, tree_of(model.state_dict()))
    rng = np.random.default_rng(0)
    patches = [rng.random((h * w, cfg.patch_dim), dtype=np.float32) for h, w in GRIDS]
    packing, flat = tower.pack(patches, GRIDS)

    first_s, _ = run_packed(tower, patches, GRIDS)
    times = {"padded": [], "per_image": [], "packed": [], "rate": []}
    for _ in range(args.rounds):
        rate, rate_src = matmul_rate()
        padded_s, padded_out = run_padded(model, patches, GRIDS)
        single_s, single_out = run_per_image(model, patches, GRIDS)
        packed_s, packed_out = run_packed(tower, patches, GRIDS)
        for key, value in zip(times, (padded_s, single_s, packed_s, rate), strict=True):
            times[key].append(value)
    parts = profile(cfg, tower.params, packing, flat)

    lengths = [h * w for h, w in GRIDS]
    padded_len = BUDGET_TOKENS * 9
    lin_packed, att_packed = layer_flops(cfg, lengths)
    lin_padded, att_padded = layer_flops(cfg, [padded_len] * len(GRIDS))
    work = args.layers * (lin_packed + att_packed)
    work_padded = args.layers * (lin_padded + att_padded)
    floor = [work / r / 1e9 for r in times["rate"]]
    ratios = {
        "padded": [a / b for a, b in zip(times["padded"], times["packed"], strict=True)],
        "per_image": [a / b for a, b in zip(times["per_image"], times["packed"], strict=True)],
        "floor": [a / b for a, b in zip(times["packed"], floor, strict=True)],
    }

    print(
        f"E2B-size tower, {args.layers} layers, items of {[n // 9 for n in lengths]} soft tokens; "
        f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'run':<34}{'patches':>8}{'GFLOP':>9}  {'time s: median [min…max]':<28}{'GFLOP/s':>8}")
    rows = [
        ("HF padded (sdpa, one batch)", padded_len * len(GRIDS), work_padded, times["padded"]),
        ("HF per image (sdpa, unpadded)", sum(lengths), work, times["per_image"]),
        ("packed (JAX, jit)", sum(lengths), work, times["packed"]),
        (f"FLOP floor ({rate_src})", sum(lengths), work, floor),
    ]
    for name, patches_n, flop, ts in rows:
        print(
            f"{name:<34}{patches_n:>8}{flop / 1e9:>9.0f}  {spread(ts, '{:.2f}'):<28}"
            f"{flop / statistics.median(ts) / 1e9:>8.1f}"
        )
    print(
        f"matmul rate {spread(times['rate'], '{:.0f}')} GFLOP/s; "
        f"packed first call incl. compile {first_s:.2f} s"
    )
    labels = {
        "padded": "HF padded / packed",
        "per_image": "HF per image / packed",
        "floor": "packed / FLOP floor",
    }
    for key, label in labels.items():
        median = statistics.median(ratios[key])
        met = median <= GOALS[key] if key == "floor" else median >= GOALS[key]
        goal = f"{'≤' if key == 'floor' else '≥'} {GOALS[key]}"
        verdict = "met" if met else "NOT met"
        print(f"{label:<24}{spread(ratios[key], '{:.2f}x'):<28} goal {goal}x: {verdict}")
    print(
        f"FLOP ratio padded/packed {work_padded / work:.2f}x "
        f"(attention {att_padded / att_packed:.2f}x, linears {lin_padded / lin_packed:.2f}x)"
    )
    print(
        f"max relative difference: packed vs HF padded {rel(packed_out, padded_out):.2e}, "
        f"vs HF per image {rel(packed_out, single_out):.2e}"
    )
    total = sum(s for _, s in parts)
    print(f"per-op profile (each part jitted alone, same shapes; sum {total:.2f} s):")
    for name, s in parts:
        print(f"  {name:<30}{s:>8.2f} s {100 * s / total:>5.1f} %")


if __name__ == "__main__":
    main()
