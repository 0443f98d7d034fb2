"""What a compute context length saves: a decode step in onnxruntime at each K, side by side.

A released model's attention shapes cut to a few layers (the first `--layers` of its pattern,
which must hold a full layer; vocabulary 4,096, no per-layer embeddings, no KV sharing: the
rest of the step is then small and the table shows attention), written as a sparse checkpoint
(no weight byte on disk; holes read as zeros, which cost onnxruntime what any values cost),
exported decode-only at ctx_len 65,536 with `--comp-ctx-lengths-decode`, sliding layers in a
ring, then one decode step timed per K (the median of `--steps`, after one warm-up), each at
position K − 1 (the most a K holds) with the same caches. The graph is one for every K; only
the fed `comp_ctx_lengths` length differs. Prints a markdown table with each K's step time and
its ratio to the step at K = ctx_len.

    python benchmarks/ccl_decode.py                       # E4B shapes, K 4096 … 65536
    python benchmarks/ccl_decode.py --decode-blocking kv_headpar:num_kv_blocks=8,skip_kv=true
    python benchmarks/ccl_decode.py --model 31B           # ~24 GB peak: its 6 layers in float32
"""

import argparse
import copy
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from export_weight_free import write_sparse_checkpoint  # noqa: E402
from gemma4_configs import CONFIGS  # noqa: E402

from codegen.cli.arguments import int_list, phase_blocking  # noqa: E402
from codegen.export.command import ExportOptions, export  # noqa: E402
from codegen.folder.sessions import open_session, read_manifest  # noqa: E402
from weights import open_checkpoint  # noqa: E402

CTX = 65536


def cut_config(model, layers):
    """The released config with its first `layers` text layers, vocabulary 4,096, no per-layer
    embeddings and no KV sharing (attention shapes as released)."""
    config = copy.deepcopy(CONFIGS[model])
    text = config["text_config"]
    types = text["layer_types"][:layers]
    if "full_attention" not in types:
        raise SystemExit(f"--layers {layers}: the first layers of {model} hold no full layer")
    text.update(
        layer_types=types,
        num_hidden_layers=layers,
        num_kv_shared_layers=0,
        vocab_size=4096,
        vocab_size_per_layer_input=4096,
        hidden_size_per_layer_input=0,
    )
    return config


def step_times(folder, ccls, steps):
    """{K: median seconds of one decode step at position K − 1} over the export in `folder`."""
    manifest = read_manifest(folder, check_shards=False)
    entry = next(g for g in manifest.graphs if g.kind == "decode")
    session = open_session(entry, folder, open_checkpoint(folder))
    shapes = entry.shapes(entry.specializations[0]["name"])
    rng = np.random.default_rng(0)
    feed = {n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items() if "past_" in n}
    feed["input_ids"] = np.full(shapes["input_ids"], 7, np.int32)
    out = {}
    for k in ccls:
        feed["position_ids"] = np.full(shapes["position_ids"], k - 1, np.int32)
        feed["comp_ctx_lengths"] = np.zeros(k, np.int64)
        session.run(["logits"], feed)  # warm-up
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            session.run(["logits"], feed)
            times.append(time.perf_counter() - start)
        out[k] = statistics.median(times)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="E4B", choices=sorted(CONFIGS))
    p.add_argument("--layers", type=int, default=6, help="first text layers kept (6)")
    p.add_argument("--ccls", type=int_list, default=(4096, 8192, 16384, 32768))
    p.add_argument("--decode-blocking", type=phase_blocking, default=("none", {}))
    p.add_argument("--steps", type=int, default=5, help="timed steps per K (5)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ccl_decode.") as tmp:
        ckpt, out = Path(tmp) / "ckpt", Path(tmp) / "out"
        write_sparse_checkpoint(ckpt, cut_config(args.model, args.layers))
        opts = ExportOptions(
            out=out, model=ckpt, budgets=(), ctx_len=CTX, phases=("decode",), verify=False,
            hash_shards=False, decode_blocking=args.decode_blocking,
            comp_ctx_lengths_decode=tuple(args.ccls),
        )  # fmt: skip
        start = time.perf_counter()
        export(opts, log=lambda msg: None)
        exported = time.perf_counter() - start
        times = step_times(out, opts.ccl_lists()["decode"], args.steps)
    mode = args.decode_blocking[0]
    print(f"{args.model} shapes, first {args.layers} layers, decode {mode}, ctx_len {CTX}; "
          f"export {exported:.1f} s; median of {args.steps} steps per K; peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")  # fmt: skip
    print("| K | decode step ms | vs K = ctx_len |")
    print("|---|---|---|")
    for k, t in times.items():
        print(f"| {k} | {t * 1e3:.1f} | {t / times[CTX]:.2f} |")


if __name__ == "__main__":
    main()
