"""Packed JAX vision tower vs transformers' padded PyTorch tower, same random weights.

The E2B-size tower (768 hidden, 12 heads × 64, FFN 3072, clipped linears) on a mixed batch of
items with 70, 140, 280 and 1120 soft tokens. transformers pads every item to the largest
budget (1120·9 = 10080 patches, HF's processor does this) and runs them as a batch; the packed
tower runs the 14490 real patches as one sequence, attention per item. Both are timed in this
one run after a warm-up (JAX's compile time is reported separately), and the outputs are
compared. Usage:

    python benchmarks/vision_packed_vs_padded.py [--layers 16] [--threads 2]

The per-layer cost is the same in every layer, so fewer layers keep the ratios and cut the
wall time; the table says how many layers ran.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers.models.gemma4.modeling_gemma4 import Gemma4VisionModel  # noqa: E402

from ref.gemma4 import VisionTower  # noqa: E402
from ref.gemma4.config import VisionConfig  # noqa: E402
from tests.hf_vision import hf_padded_inputs, hf_vision_config, randomize_, tree_of  # noqa: E402

# (h, w) patch grids of 70, 140, 280 and 1120 soft tokens (3×3 patches per soft token).
GRIDS = [(21, 30), (30, 42), (42, 60), (84, 120)]
BUDGET_TOKENS = 1120


def layer_flops(cfg, lengths):
    """(linear, attention) FLOPs of one encoder layer over items of the given patch lengths."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qo = 2 * d * cfg.num_attention_heads * hd
    kv = 2 * d * cfg.num_key_value_heads * hd
    mlp = 3 * d * cfg.intermediate_size
    per_token = 2 * (qo + kv + mlp)
    attn = sum(4 * n * n * cfg.num_attention_heads * hd for n in lengths)
    return per_token * sum(lengths), attn


def run_padded(model, patches, grids):
    values, pos = hf_padded_inputs(
        patches, grids, pad_tokens=BUDGET_TOKENS - max(h * w for h, w in grids) // 9
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model(pixel_values=values, pixel_position_ids=pos).last_hidden_state
    return time.perf_counter() - t0, out.numpy(), values.shape[1]


def run_packed(tower, patches, grids):
    t0 = time.perf_counter()
    packing, out = tower.run(patches, grids)
    jax.block_until_ready(out["pooled"])
    compile_and_run = time.perf_counter() - t0
    t0 = time.perf_counter()
    packing, out = tower.run(patches, grids)
    pooled = np.asarray(jax.block_until_ready(out["pooled"]))
    return time.perf_counter() - t0, compile_and_run, pooled


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="encoder layers (E2B: 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = VisionConfig(num_hidden_layers=args.layers, use_clipped_linears=True)
    hf_cfg = hf_vision_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    model = randomize_(Gemma4VisionModel(hf_cfg).eval(), seed=0)
    tower = VisionTower(cfg, tree_of(model.state_dict()))
    rng = np.random.default_rng(0)
    patches = [rng.random((h * w, cfg.patch_dim), dtype=np.float32) for h, w in GRIDS]

    packed_s, packed_first_s, packed_out = run_packed(tower, patches, GRIDS)
    padded_s, padded_out, padded_len = run_padded(model, patches, GRIDS)
    err = np.abs(packed_out - padded_out).max() / np.abs(padded_out).max()

    lengths = [h * w for h, w in GRIDS]
    lin_packed, att_packed = layer_flops(cfg, lengths)
    lin_padded, att_padded = layer_flops(cfg, [padded_len] * len(GRIDS))
    total_packed = args.layers * (lin_packed + att_packed)
    total_padded = args.layers * (lin_padded + att_padded)

    print(f"E2B-size tower, {args.layers} layers, items of {[n // 9 for n in lengths]} soft tokens")
    print(f"{'tower':<28}{'patches':>9}{'TFLOP':>9}{'time s':>10}{'GFLOP/s':>10}")
    print(
        f"{'HF padded (PyTorch, sdpa)':<28}{padded_len * len(GRIDS):>9}"
        f"{total_padded / 1e12:>9.2f}{padded_s:>10.2f}{total_padded / padded_s / 1e9:>10.1f}"
    )
    print(
        f"{'packed (JAX, jit)':<28}{sum(lengths):>9}"
        f"{total_packed / 1e12:>9.2f}{packed_s:>10.2f}{total_packed / packed_s / 1e9:>10.1f}"
    )
    print(f"packed first call incl. compile: {packed_first_s:.2f} s")
    print(
        f"speed-up (padded time / packed time): {padded_s / packed_s:.2f}x   "
        f"FLOP ratio: {total_padded / total_packed:.2f}x   "
        f"(attention {att_padded / att_packed:.2f}x, linears {lin_padded / lin_packed:.2f}x)"
    )
    print(f"max relative difference packed vs padded: {err:.2e}")


if __name__ == "__main__":
    main()
