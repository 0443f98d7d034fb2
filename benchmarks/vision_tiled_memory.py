"""Peak memory of one run of the exported vision graph in onnxruntime: dense mask vs tiles.

The E2B-width tower (768 hidden, 12 heads × 64, FFN 3072; `--heads 16` for the wider towers)
with `--layers` encoder layers (default 1: the attention's scores dominate and every layer's
are alike), exported as `python -m codegen export` exports the vision graph (the weights as
graph inputs here, random), once per `--tiles` setting; "1x1" is the dense segment mask over the
whole packed sequence. Each graph runs once in its own subprocess on the same packed batch at
`--budget` (those of items of 560, 280, 140 and 70 soft tokens that fit, then filler: 70 at
1120), and the
table gives each process's peak RSS (`wait4`) and its rise during the run over the RSS after
the session was built, the run time, and the largest difference from the first graph's output
relative to its largest value. Usage:

    python benchmarks/vision_tiled_memory.py [--budget 1120] [--tiles 1x1,9x9] [--heads 12]

One graph at a time: the dense graph at budget 1120 holds several H·N² float buffers (N = 9 ×
budget patches), about 15 GB with 12 heads.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codegen.check.structure import no_unclamped_dynamic_slice  # noqa: E402
from codegen.graphs.vision import vision_graph  # noqa: E402
from codegen.lower.trace import trace  # noqa: E402
from ref.gemma4.config import VisionConfig  # noqa: E402
from ref.gemma4.packing import pack  # noqa: E402
from ref.gemma4.params import vision_param_shapes  # noqa: E402

# (h, w) patch grids of 560, 280, 140 and 70 soft tokens (3×3 patches per soft token).
GRIDS = [(60, 84), (42, 60), (30, 42), (21, 30)]


def _config(args):
    return VisionConfig(
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
    )


def _hf_config(cfg):
    fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "text_hidden_size"}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    return fields


def _tiles(text):
    q, _, kv = text.partition("x")
    return int(q), int(kv or q)


def _feed(cfg, budget, seed=0):
    """Inputs of the graph: the packed items at `budget`, then random weights (scale 0.02)."""
    rng = np.random.default_rng(seed)
    grids, used = [], 0
    for h, w in GRIDS:
        if used + h * w // 9 <= budget:
            grids.append((h, w))
            used += h * w // 9
    packing = pack(grids, position_embedding_size=cfg.position_embedding_size, budget=budget)
    n = packing.positions.shape[0]
    feed = {
        "pixel_patches": rng.random((n, cfg.patch_dim), dtype=np.float32),
        "positions": packing.positions,
        "segment_ids": packing.segment_ids,
        "pool_index": packing.pool_index,
    }
    for name, shape in sorted(vision_param_shapes(cfg).items()):
        scale = 1.0 if name.endswith("layernorm.weight") or "norm" in name else 0.02
        feed[name] = (rng.standard_normal(shape) * scale).astype(np.float32)
    return feed


def child(args):
    """Run one graph once; print {"rss_before", "peak", "run_s"} as JSON, save the output."""
    import onnxruntime as ort

    cfg = _config(args)
    feed = _feed(cfg, args.budget)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # Without the arena each tensor is its own allocation, freed when dead: the peak RSS is the
    # peak of live tensors (with it, the arena's growth and fragmentation add to both graphs).
    opts.enable_cpu_mem_arena = args.arena
    session = ort.InferenceSession(args.child, opts, providers=["CPUExecutionProvider"])
    feed = {i.name: feed[i.name] for i in session.get_inputs()}
    before = _rss_now()
    t0 = time.perf_counter()
    out = session.run(None, feed)[0]
    run_s = time.perf_counter() - t0
    np.save(args.child + ".out.npy", out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"rss_before": before, "peak": peak, "run_s": run_s}))


def _rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _export(cfg, budget, tiles, path):
    shapes = vision_param_shapes(cfg)
    spec = vision_graph(_hf_config(cfg), shapes, (budget,), tiles=tiles)
    t0 = time.perf_counter()
    no_unclamped_dynamic_slice(spec, shapes)  # as the export does (the layer's ONNX function)
    model = trace(spec, {n: SimpleNamespace(shape=s) for n, s in shapes.items()})
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    nodes = len(model.graph.node) + sum(len(f.node) for f in model.functions)
    return time.perf_counter() - t0, nodes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=1120)
    parser.add_argument("--tiles", default="1x1,9x9", help="comma-separated QxKV; 1x1 = dense")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--arena", action="store_true", help="onnxruntime's CPU memory arena on")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    cfg = _config(args)
    rows, first = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for text in args.tiles.split(","):
            tiles = _tiles(text)
            path = os.path.join(tmp, f"vision_{text}.onnx")
            trace_s, nodes = _export(cfg, args.budget, tiles, path)
            cmd = (
                [sys.executable, __file__, "--child", path]
                + [f"--{k}={getattr(args, k)}" for k in ("budget", "heads", "layers")]
                + ["--arena"] * args.arena
            )
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            m = json.loads(done.stdout.strip().splitlines()[-1])
            out = np.load(path + ".out.npy")
            first = out if first is None else first
            diff = float(np.abs(out - first).max() / np.abs(first).max())
            rows.append((text, nodes, trace_s, m, diff))
            print(f"{text}: peak {m['peak'] / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    n = args.budget * cfg.pooling_kernel_size**2
    print(
        f"vision graph in onnxruntime, budget {args.budget} ({n} patches), {args.layers} layer(s), "
        f"{cfg.hidden_size} hidden, {cfg.num_attention_heads} heads × {cfg.head_dim}, "
        f"CPU memory arena {'on' if args.arena else 'off'}"
    )
    head = f"{'tiles':<7}{'nodes':>7}{'trace s':>9}{'peak GiB':>10}{'run GiB':>9}"
    print(head + f"{'run s':>8}{'peak ratio':>12}{'run ratio':>11}{'max rel diff':>14}")
    base = rows[0][3]
    for text, nodes, trace_s, m, diff in rows:
        grow = m["peak"] - m["rss_before"]
        print(
            f"{text:<7}{nodes:>7}{trace_s:>9.1f}{m['peak'] / 2**30:>10.2f}{grow / 2**30:>9.2f}"
            f"{m['run_s']:>8.1f}{m['peak'] / base['peak']:>12.3f}"
            f"{grow / (base['peak'] - base['rss_before']):>11.3f}{diff:>14.1e}"
        )


if __name__ == "__main__":
    main()
