"""What each way of running Gemma 4's experts costs: one 26B-A4B MoE layer's experts (hidden
2,816, 128 experts of 704, top 8) exported alone through jax2onnx in each mode of
`ref.moe_modes`, run in onnxruntime (CPU, float32).

Two comparisons, as QEfficient compiles them: a decode step (`--decode-tokens`, 1: batch 1)
dense vs gather, and a prefill chunk of `--tokens` (1,024) dense vs nsp (`--num-nsp` 16 cores,
`--packed-chunk` 256 rows). Per case: the bytes of weights the matmuls read, their FLOPs, the
ONNX graph's op set checked against `codegen.lower.ops`, the median onnxruntime time of `--runs`
(after one warm-up), the peak RSS of the runs and what they added to the resident inputs
(weights included; each case runs in its own process), and the largest difference
from dense (the same inputs: every mode must give dense's answer). Routing: each token's
top-k experts drawn uniformly. Prints a markdown table.

    python benchmarks/moe.py                          # the real layer: ~3 GB of float32 weights
    python benchmarks/moe.py --experts 32 --tokens 256 --runs 1   # a quick look
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _inputs(tokens, hidden, experts, inter, top_k, seed=0):
    """x [T, H], gate_up [E, 2I, H], down [E, H, I], weights [T, K], index [T, K] (float32,
    int32): the same for every mode at one T."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden), dtype=np.float32)
    gate_up = rng.standard_normal((experts, 2 * inter, hidden), dtype=np.float32)
    down = rng.standard_normal((experts, hidden, inter), dtype=np.float32)
    gate_up *= 0.02  # in place: no second copy of 3 GB
    down *= 0.02
    index = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.dirichlet(np.ones(top_k), tokens).astype(np.float32)
    return {"x": x, "gate_up": gate_up, "down": down, "weights": weights, "index": index}


def costs(mode, tokens, hidden, experts, inter, top_k):
    """(weight bytes the matmuls read, matmul FLOPs) of one call in `mode` (float32)."""
    per_expert = 3 * hidden * inter  # gate, up, down
    if mode.name == "gather":  # each token's k experts' matrices, gathered
        return 4 * tokens * top_k * per_expert, 2 * tokens * top_k * per_expert
    if mode.name == "nsp":  # every chunk of every expert runs (static shapes)
        chunks = tokens // mode.packed_chunk
        return 4 * chunks * experts * per_expert, 2 * tokens * experts * per_expert
    return 4 * experts * per_expert, 2 * tokens * experts * per_expert


def export(mode, tokens, hidden, experts, inter, top_k, path):
    """Write the experts in `mode` as an ONNX graph (weights as inputs) → its op types."""
    import jax
    from jax2onnx import to_onnx

    from codegen.check import structure as checks
    from codegen.lower.ops import OPSET
    from ref.gemma4 import moe

    def fn(x, gate_up, down, weights, index):
        return moe.run(mode, x, gate_up, down, weights, index)

    shapes = [
        ((tokens, hidden), "float32"),
        ((experts, 2 * inter, hidden), "float32"),
        ((experts, hidden, inter), "float32"),
        ((tokens, top_k), "float32"),
        ((tokens, top_k), "int32"),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    model = to_onnx(fn, args, model_name=f"moe_{mode.name}", opset=OPSET,
                    input_names=["x", "gate_up", "down", "weights", "index"],
                    output_names=["out"])  # fmt: skip
    checks.allowed_ops(model)
    path.write_bytes(model.SerializeToString())
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    return sorted({n.op_type for n in nodes})


def _status_kib(field):
    """A field of /proc/self/status in KiB (VmRSS: now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}")


def run_case(args):
    """In its own process: one graph's runs → JSON on stdout."""
    import onnxruntime as ort

    feed = _inputs(args.case_tokens, args.hidden, args.experts, args.inter, args.top_k)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(args.case, options, providers=["CPUExecutionProvider"])
    before = _status_kib("VmRSS")
    # reset the peak (Linux: clear_refs 5), so the run's own peak is measured, not the inputs'
    Path("/proc/self/clear_refs").write_text("5")
    out = session.run(None, feed)[0]  # warm-up
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        out = session.run(None, feed)[0]
        times.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM")
    np.save(args.case + ".out.npy", out)
    print(json.dumps({"s": statistics.median(times), "peak_kib": peak, "run_kib": peak - before}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--inter", type=int, default=704, help="moe_intermediate_size")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024, help="prefill chunk (batch × seq_len)")
    p.add_argument("--decode-tokens", type=int, default=1, help="decode rows (batch)")
    p.add_argument("--num-nsp", type=int, default=16)
    p.add_argument("--packed-chunk", type=int, default=256)
    p.add_argument("--runs", type=int, default=2, help="timed runs per case (median)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--case-tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        return run_case(args)

    from ref.moe_modes import MoeMode

    nsp = MoeMode("nsp", args.num_nsp, args.packed_chunk)
    nsp.check(args.experts, args.tokens)
    cases = [
        ("decode", args.decode_tokens, MoeMode()),
        ("decode", args.decode_tokens, MoeMode("gather")),
        ("prefill", args.tokens, MoeMode()),
        ("prefill", args.tokens, nsp),
    ]
    shape = (args.hidden, args.experts, args.inter, args.top_k)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for phase, tokens, mode in cases:
            path = Path(tmp) / f"{phase}_{mode.name}.onnx"
            start = time.perf_counter()
            ops = export(mode, tokens, *shape, path)
            traced = time.perf_counter() - start
            cmd = [sys.executable, __file__, "--case", str(path), "--case-tokens", str(tokens),
                   "--hidden", str(args.hidden), "--experts", str(args.experts),
                   "--inter", str(args.inter), "--top-k", str(args.top_k),
                   "--runs", str(args.runs)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            out = np.load(str(path) + ".out.npy")
            if mode.name == "dense":
                dense = out
            diff = float(np.abs(out - dense).max() / np.abs(dense).max())
            read, flops = costs(mode, tokens, *shape)
            rows.append((phase, tokens, str(mode), read, flops, result, diff, traced, len(ops)))
            print(f"{phase} {mode}: {result['s']:.3f} s", file=sys.stderr)
    print(f"experts: hidden {args.hidden}, {args.experts} experts of {args.inter}, top "
          f"{args.top_k}; onnxruntime CPU float32, median of {args.runs}\n")  # fmt: skip
    print("| phase | tokens | mode | weight bytes read | GFLOP | ort s | vs dense | peak RSS GiB "
          "| run adds GiB | rel diff vs dense | export s | op types |")  # fmt: skip
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {}
    for phase, tokens, mode, read, flops, r, diff, traced, ops in rows:
        base.setdefault(phase, r["s"])
        print(f"| {phase} | {tokens} | {mode} | {read / 2**20:,.0f} MiB | {flops / 1e9:.1f} "
              f"| {r['s']:.3f} | {r['s'] / base[phase]:.2f} | {r['peak_kib'] / 2**20:.2f} "
              f"| {r['run_kib'] / 2**20:.2f} | {diff:.1e} | {traced:.1f} | {ops} |")  # fmt: skip


if __name__ == "__main__":
    main()
