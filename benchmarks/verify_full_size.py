"""`verify` of released-size Gemma 4 exports on one host: peak memory, time, worst error.

For each model asked for (`benchmarks/gemma4_configs.py`) the benchmark writes a checkpoint
with the released shapes, sharded as `export_weight_free.py` shards it, whose tensors hold
random bf16 values (normal, std 0.02 for matrices; near 1 for norm scales so activations stay
in range; clipped linears' bounds near ∓4, since 2026-12-06: before, near 0, they clipped every
value): every tensor (`--random all`, the default for E2B), or the first `--random N`
decoder layers of each kind plus every tensor outside the decoder layers, the rest left as
holes that read as zeros (a 31B-shape checkpoint would otherwise write 58 GiB), and then
the layers `verify` will check by layer function filled too (`checked_layers`). It exports it
(`--no-verify`, shapes from the options below) and runs, in a child process,

    python -m codegen verify OUT

measuring wall seconds and peak memory (the larger of `os.wait4`'s `ru_maxrss` of that one
process and the summed resident size of it and the processes it starts, sampled every 0.5 s
(`tree_rss`): `verify --precision` and `--write-npi` run parts in spawned processes) and
reading the table's worst relative error per graph and where it was (layer or glue). The
default run is E2B at seq_len 128 / ctx_len 8192 with the sliding ring (about 15 minutes);
`--production` uses QEfficient's production shapes (prefill seq_len 1024 in qkv with 8 query
chunks × 16 KV blocks, decode kv_headpar 8 blocks with skip_kv, ctx_len 65536, sliding ring);
`--models E2B,31B`; `--full-batch-size N` exports continuous batching (N cache slots);
`--graphs decode,prefill` verifies only those graphs (`verify --graph`); `--plan` runs
`verify OUT --precision fp16 --write-npi` instead (the float16 node-precision plans).
`verify OUT` goes by layer function at these sizes (`codegen.check.by_function`: the glue and
one call per function, every call's bindings proven); `--exhaustive` passes `--exhaustive`
(every call, layer by layer) to compare; `--seed N` chooses the calls checked.

Goal (issue 23): peak RSS <= 8 GB for each.

    python benchmarks/verify_full_size.py [--models E2B] [--random all|N] [--production]
        [--full-batch-size N] [--graphs NAMES] [--plan] [--exhaustive] [--seed N] [--keep DIR]
"""

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from export_weight_free import (  # noqa: E402
    CONFIGS,
    child,
    tree_child,
    tree_rss,
    write_sparse_checkpoint,
)

sys.path.insert(0, str(ROOT))
from weights import open_checkpoint  # noqa: E402

GOAL_RSS = 8e9
CHUNK = 1 << 24  # values drawn at a time
PRODUCTION = [
    "--seq-len", "1024", "--ctx-len", "65536", "--sliding-ring",
    "--prefill-blocking", "qkv:prefill_block_chunks=8,num_kv_blocks=16",
    "--decode-blocking", "kv_headpar:num_kv_blocks=8,skip_kv=true",
]  # fmt: skip
SMALL = ["--seq-len", "128", "--ctx-len", "8192", "--sliding-ring"]
LAYER = re.compile(r"\.layers\.(\d+)\.")


def _scale_of(name):
    """(mean, std) of the random values of a tensor: norm scales near 1, a clipped linear's
    bounds near ∓4 (unit-RMS inputs: they clip the tails only; near 0 they clipped every
    value), the rest N(0, 0.02)."""
    if "norm" in name or name.endswith("layer_scalar"):
        return 1.0, 0.05
    if name.endswith(("input_min", "output_min", "input_max", "output_max")):
        return (-4.0 if name.endswith("min") else 4.0), 0.5
    return 0.0, 0.02


def fill(info, rng):
    """Write random bf16 values over tensor `info`'s bytes in its shard (in place)."""
    mean, std = _scale_of(info.name)
    count = math.prod(info.shape)
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        for start in range(0, count, CHUNK):
            n = min(CHUNK, count - start)
            x = (rng.standard_normal(n, dtype=np.float32) * std + mean).view(np.uint32)
            f.write((x >> 16).astype(np.uint16).tobytes())


def chosen(names, random):
    """The tensors to fill: all, or those outside decoder layers plus the first `random`
    layers (by index) of the language model and the vision tower."""
    if random == "all":
        return list(names)
    keep = []
    for n in names:
        m = LAYER.search(n)
        if m is None or int(m.group(1)) < int(random):
            keep.append(n)
    return keep


def checked_layers(out, seed):
    """The layer indices `verify OUT --seed seed` checks by layer function in any graph of the
    export `out` (`by_function.chosen_calls`; a graph's call k computes its tower's or
    decoder's layer k)."""
    from codegen.check import by_function
    from codegen.folder import manifest

    found = set()
    for entry in manifest.load(out).graphs:
        model = onnx.load(str(out / entry.file), load_external_data=False)
        found |= set(by_function.chosen_calls(model, seed, entry.name).values())
    return found


def fill_names(folder, names, seed):
    """Fill the checkpoint's tensors `names` (in order) with random values → bytes filled."""
    ckpt = open_checkpoint(folder)
    rng = np.random.default_rng(seed)
    for name in names:
        fill(ckpt.tensors[name], rng)
    return sum(ckpt.tensors[n].nbytes for n in names)


def fill_layers(folder, layers, random, seed=1):
    """Fill with random values the tensors of `layers` (indices) not filled by `--random`
    (`chosen`) → bytes filled: the layers by-function verify checks get real weights."""
    names = sorted(open_checkpoint(folder).tensors)
    done = set(chosen(names, random))
    mine = [n for n in names if (m := LAYER.search(n)) and int(m.group(1)) in layers]
    return fill_names(folder, [n for n in mine if n not in done], seed)


def write_checkpoint(folder, config, random, seed=0, shapes=None):
    """A sparse checkpoint (export_weight_free) of the tensors `shapes` (default all) with the
    chosen tensors filled; -> bytes filled."""
    write_sparse_checkpoint(folder, config, shapes)
    return fill_names(folder, chosen(sorted(open_checkpoint(folder).tensors), random), seed)


def worst_per_graph(text):
    """{graph: (rel err, output, where, all ok)} from verify's table."""
    out = {}
    for line in text.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) != 7 or parts[0] == "graph":
            continue
        graph, _, output, _, rel, where, ok = parts
        rel = float(rel)
        old = out.get(graph)
        good = (old[3] if old else True) and ok == "ok"
        if old is None or rel > old[0]:
            out[graph] = (rel, output, where, good)
        else:
            out[graph] = (*old[:3], good)
    return out


def bench(name, root, args):
    """Checkpoint, export and verify one model; -> result dict."""
    model, out = root / f"{name}-ckpt", root / f"{name}-out"
    if not model.exists():
        start = time.perf_counter()
        filled = write_checkpoint(model, CONFIGS[name], args.random)
        print(f"{name}: wrote {filled / 2**30:.1f} GiB of random bf16 in "
              f"{time.perf_counter() - start:.0f} s", flush=True)  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    shapes = PRODUCTION if args.production else SMALL
    export = [sys.executable, "-m", "codegen", "export", "--model", str(model), "--out", str(out)]
    export += ["--budgets", "280,1120", "--no-verify", "--no-hash", *shapes]
    if args.full_batch_size:
        export += ["--full-batch-size", str(args.full_batch_size)]
    rc, export_s, export_rss = child(export, root / f"{name}-export.log")
    if rc:
        return {"model": name, "error": (root / f"{name}-export.log").read_text()[-2000:]}
    if not args.plan and not args.exhaustive:
        layers = checked_layers(out, args.seed)
        filled = fill_layers(model, layers, args.random)
        print(f"{name}: layers {sorted(layers)} checked by function; {filled / 2**30:.1f} GiB "
              "more of them filled", flush=True)  # fmt: skip
    log = root / f"{name}-{'plan' if args.plan else 'verify'}.log"
    verify = [sys.executable, "-m", "codegen", "verify", str(out)]
    for graph in filter(None, args.graphs.split(",")):
        verify += ["--graph", graph]
    if args.plan:
        verify += ["--precision", "fp16", "--write-npi"]
    else:
        verify += ["--seed", str(args.seed)] + (["--exhaustive"] if args.exhaustive else [])
    rc, wall, one, summed = tree_child(verify, log, measure=tree_rss)
    rss = max(one, summed)
    text = log.read_text(errors="replace")
    if args.plan:
        plans = [line for line in text.splitlines() if "node(s) in float32" in line]
        return {"model": name, "rc": rc, "verify_s": wall, "verify_rss": rss, "plans": plans,
                "parted": [line.strip() for line in text.splitlines() if "ref parts" in line],
                "log": str(log)}  # fmt: skip
    return {
        "model": name,
        "way": "exhaustive" if args.exhaustive else "default",
        "checked": [line.strip() for line in text.splitlines() if "(seed " in line],
        "export_s": export_s,
        "export_rss": export_rss,
        "verify_s": wall,
        "verify_rss": rss,
        "rc": rc,
        "graphs": worst_per_graph(text),
        "log": str(log),
    }


def table(results):
    rows = ["| model | graph | worst rel err | output | where | ok | verify s | peak RSS GB |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            rows.append(f"| {r['model']} | export failed | | | | | | |")
            continue
        if "plans" in r:
            cost = f"{r['verify_s']:.0f} s | {r['verify_rss'] / 1e9:.2f} GB"
            head = f"| {r['model']} plan (exit {r['rc']}) |"
            rows += [f"{head} {line} | {cost} |" for line in r["plans"] + r["parted"]]
            continue
        for g, (rel, output, where, ok) in r["graphs"].items():
            verdict = "ok" if ok else "MISMATCH"
            rows.append(
                f"| {r['model']} | {g} | {rel:.2e} | {output} | {where} | {verdict} | "
                f"{r['verify_s']:.0f} | {r['verify_rss'] / 1e9:.2f} |"
            )
    return "\n".join(rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="E2B")
    p.add_argument(
        "--random", default="all", help="'all' or N: random values in the first N layers"
    )
    p.add_argument("--production", action="store_true", help="QEfficient's production shapes")
    p.add_argument("--full-batch-size", type=int, help="continuous batching: N cache slots")
    p.add_argument("--graphs", default="", help="verify only these graphs (comma-separated)")
    p.add_argument("--keep", type=Path, help="keep checkpoints and exports here (reused)")
    p.add_argument("--plan", action="store_true",
                   help="instead of verify: `verify --precision fp16 --write-npi`, the float16 "
                        "node-precision plan of each graph (issue 41)")  # fmt: skip
    p.add_argument(
        "--exhaustive",
        action="store_true",
        help="verify every layer call (`verify --exhaustive`), not by layer function",
    )
    p.add_argument("--seed", type=int, default=0, help="verify's --seed: the calls checked")
    args = p.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="verify_full_size."))
    root.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for name in args.models.split(","):
            results.append(bench(name, root, args))
            shown = {k: v for k, v in results[-1].items() if k not in ("graphs", "plans")}
            print(json.dumps(shown), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    ok = all("error" not in r and r["rc"] == 0 and r["verify_rss"] <= GOAL_RSS for r in results)
    if args.plan:
        print("(a plan of random weights: what they overflow, not what a released model does)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
