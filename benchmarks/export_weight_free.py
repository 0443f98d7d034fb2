"""Weight-free export of the released Gemma 4 models at full size: time, memory, bytes copied.

For each of E2B, E4B, 31B and 26B-A4B (`benchmarks/gemma4_configs.py`: the released config.json
dicts) and the 12B Unified (its shape partly assumed: `UNIFIED_CONFIGS` there; its embedder
graphs in place of the towers) the benchmark writes a sparse checkpoint: config.json plus a
bf16 tensor for every parameter the model has (`text_param_shapes`, `vision_param_shapes` under
`model.vision_tower.`, and `EMBED_VISION`; E2B's and E4B's audio tower and embed_audio,
`audio_param_shapes`), sharded as transformers' `save_pretrained` does
(names in sorted order, greedily into shards of at most 5 GB,
`model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`). Each shard is a real
safetensors header followed by a hole (`os.truncate`): the tens of GB of weights take no disk
and no byte of them is ever written or read; the allocated blocks are checked to stay small.

It then runs, in a subprocess with the repository root as working folder,

    python -m codegen export --model CKPT --out OUT --budgets 280,1120 --seq-len 128 \\
        --ctx-len 8192 --no-verify --no-hash

which writes the vision (one specialization per budget), audio (E2B, E4B: the default audio
budgets 188 and 750, 4 clips), prefill and decode graphs with external initializers pointing
into hard links of the shards. Measured per model:
- wall s: the whole child process, from spawn to exit (interpreter start, imports, reading
  the checkpoint headers, tracing, serializing, checks), `time.perf_counter` around it;
- peak RSS: `os.wait4` on the child's pid returns its `ru_maxrss` (KiB on Linux): the high
  water mark of that one process (or of the largest of the descendants it waited for), not a
  sum, and not polluted by earlier children as `RUSAGE_CHILDREN` would be;
- nodes, functions, ONNX MB and bytes copied: from OUT/manifest.json.
After the export the output folder's shards must be hard links of the checkpoint's (same
inode) and still sparse; a copy is reported as a failure.

Goal per model, on a 2-core machine: whole export < 30 s, peak RSS < 1.5 GB, 0 weight bytes
copied. For scale, QEfficient publishes 65-568 s per graph for Gemma 4 E2B.

    python benchmarks/export_weight_free.py [--models E2B,E4B,31B,26B-A4B,12B] [--keep DIR]
        [--seq-len 128] [--ctx-len 8192] [--compare-inline]

`--compare-inline` also exports the first model with `--no-subfunctions` (repeated layers
inlined instead of ONNX functions) and prints both exports' time, RSS and size.
Exit status 0 when every model's export ran and met the goal (the inlined one is not judged).
"""

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemma4_configs import CONFIGS as RELEASED  # noqa: E402
from gemma4_configs import UNIFIED_CONFIGS  # noqa: E402

from codegen.graphs import unified  # noqa: E402
from codegen.graphs.audio import audio_param_shapes  # noqa: E402
from ref.gemma4 import unified_config  # noqa: E402
from ref.gemma4.audio_config import AudioConfig  # noqa: E402
from ref.gemma4.config import VisionConfig  # noqa: E402
from ref.gemma4.params import EMBED_VISION, text_param_shapes, vision_param_shapes  # noqa: E402
from ref.gemma4.text_config import TextConfig  # noqa: E402
from weights import plan_shards  # noqa: E402

CONFIGS = {**RELEASED, **UNIFIED_CONFIGS}  # the 12B Unified's shape partly assumed (see there)
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size="5GB"
GOAL_S = 30.0
GOAL_RSS = 1.5e9  # bytes
SPARSE_SLACK = 1 << 20  # allocated bytes allowed per shard beyond its header


def unified_shapes(config):
    """{checkpoint name: shape} of a gemma4_unified model: decoder and both embedders."""
    shapes = dict(text_param_shapes(unified_config.text_config(config)))
    shapes.update(unified.vision_param_shapes(unified_config.vision_config(config)))
    shapes.update(unified.audio_param_shapes(unified_config.audio_config(config)))
    return {n: tuple(s) for n, s in sorted(shapes.items())}


def tensor_shapes(config):
    """{checkpoint name: shape} of every parameter of the model `config` describes."""
    if unified.is_unified(config):
        return unified_shapes(config)
    shapes = dict(text_param_shapes(TextConfig.from_hf(config)))
    vision = VisionConfig.from_hf(config)
    for name, shape in vision_param_shapes(vision).items():
        shapes["model.vision_tower." + name] = shape
    shapes[EMBED_VISION] = (config["text_config"]["hidden_size"], vision.hidden_size)
    if config.get("audio_config") is not None:
        shapes.update(audio_param_shapes(AudioConfig.from_hf(config)))
    return {n: tuple(s) for n, s in sorted(shapes.items())}


def write_sparse_shard(path, shapes, dtypes=None):
    """A safetensors file of bf16 tensors (or dtypes {name: ("I64", 8)}: safetensors code and
    bytes per element) whose data region is a hole; -> header bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        code, size = (dtypes or {}).get(name, ("BF16", 2))
        nbytes = size * math.prod(shape)
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)
    return 8 + len(raw)


def allocated(path):
    """Bytes of disk a file really takes (st_blocks are 512-byte units)."""
    return os.stat(path).st_blocks * 512


def write_sparse_checkpoint(folder, config, shapes=None):
    """config.json + sharded sparse safetensors + index of the tensors `shapes` ({name:
    shape}; default every parameter, `tensor_shapes`); -> (logical bytes of the weights,
    shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = tensor_shapes(config) if shapes is None else shapes
    plan = plan_shards({n: 2 * math.prod(s) for n, s in shapes.items()}, MAX_SHARD_BYTES)
    weight_map = {}
    for i, names in enumerate(plan):
        shard = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        head = write_sparse_shard(folder / shard, {n: shapes[n] for n in names})
        if allocated(folder / shard) > head + SPARSE_SLACK:
            raise RuntimeError(f"{folder / shard}: {allocated(folder / shard)} bytes allocated")
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(2 * math.prod(s) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total, len(plan)


def run_export(model, out, args, log, extra=(), hashed=False):
    """Export in a child process (the shards hashed only when `hashed`); -> (exit code,
    wall s, peak RSS bytes)."""
    cmd = [
        sys.executable, "-m", "codegen", "export",
        "--model", str(model), "--out", str(out),
        "--budgets", "280,1120",
        "--seq-len", str(args.seq_len), "--ctx-len", str(args.ctx_len),
        "--no-verify", *(() if hashed else ("--no-hash",)), *extra,
    ]  # fmt: skip
    return child(cmd, log)


def child(cmd, log, box=None):
    """Run cmd in the repository root with output to `log`; -> (exit code, wall s, peak RSS
    bytes of that one process). box: a dict given the child's "pid" once it runs."""
    with open(log, "wb") as f:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        if box is not None:
            box["pid"] = proc.pid
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
    return proc.returncode, wall, usage.ru_maxrss * 1024


def tree_child(cmd, log, every=0.5, measure=None):
    """`child`, with the memory of the process and every process it starts summed: ->
    (exit code, wall s, peak RSS bytes of the largest one process, peak of the processes'
    summed memory, sampled every `every` s). measure(pid): that sum (default `tree_pss`,
    exact for shared pages but a page-table walk: ~0.13 s of CPU per sample of a 6 GB
    process, a quarter of a core at 0.5 s; `tree_rss` reads counters)."""
    peak, box, measure = [0], {}, measure or tree_pss

    def sample():
        while "done" not in box:
            if "pid" in box:
                peak[0] = max(peak[0], measure(box["pid"]))
            time.sleep(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc, wall, rss = child(cmd, log, box)
    box["done"] = True
    sampler.join()
    return rc, wall, rss, peak[0]


def tree_pss(pid):
    """Bytes of proportional set size (`/proc/PID/smaps_rollup`: shared pages split among
    their sharers) of process pid and its descendants; 0 for those already gone."""
    return _tree_sum(pid, "smaps_rollup", "Pss:")


def tree_rss(pid):
    """Bytes of resident set size (`/proc/PID/status`' VmRSS: a page two processes share
    counted in each, so at least `tree_pss`) of process pid and its descendants."""
    return _tree_sum(pid, "status", "VmRSS:")


def _tree_sum(pid, file, key):
    """The sum over process pid and its descendants of the kB figure on the line of
    /proc/PID/`file` starting with `key`, in bytes; 0 for processes already gone."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += [c for c, parent in parents.items() if parent == p]
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/{file}") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
        except OSError:
            continue
    return total


def check_links(model, out, manifest):
    """Problems with the exported shards: not hard links of the checkpoint's, or not sparse."""
    problems = []
    for s in manifest["shards"]:
        src, dst = model / s["file"], out / s["file"]
        if not dst.is_file():
            problems.append(f"{dst}: missing")
        elif os.stat(src).st_ino != os.stat(dst).st_ino:
            problems.append(f"{dst}: not a hard link of {src}")
        if dst.is_file() and allocated(dst) > SPARSE_SLACK + (1 << 24):
            problems.append(f"{dst}: {allocated(dst)} bytes allocated (no longer sparse)")
    return problems


def tail(path, lines=25):
    text = Path(path).read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in text[-lines:])


def bench(name, root, args, extra=(), label=None):
    """Write (once) the sparse checkpoint of `name`, export it; -> a result dict."""
    label = label or name
    model = root / name / "checkpoint"
    if not (model / "model.safetensors.index.json").is_file():
        write_sparse_checkpoint(model, CONFIGS[name])
    index = json.loads((model / "model.safetensors.index.json").read_text())
    result = {
        "model": label,
        "ckpt_gib": index["metadata"]["total_size"] / 2**30,
        "shards": len(set(index["weight_map"].values())),
    }
    out = root / name / ("export-inline" if extra else "export")
    log = root / name / (out.name + ".log")
    code, wall, rss = run_export(model, out, args, log, extra)
    result.update(code=code, wall=wall, rss=rss, problems=[])
    if code != 0:
        result["problems"].append(f"export exited {code}; output tail:\n{tail(log)}")
        return result
    manifest = json.loads((out / "manifest.json").read_text())
    graphs = manifest["graphs"]
    result.update(
        graphs=[g["name"] for g in graphs],
        nodes=[g["nodes"] for g in graphs],
        functions=[len(g["functions"]) for g in graphs],
        onnx_mb=sum(g["onnx_bytes"] for g in graphs) / 1e6,
        trace_s=sum(g["trace_s"] for g in graphs),
        copied=manifest["bytes_copied"],
    )
    result["problems"] += check_links(model, out, manifest)
    if not args.keep:
        shutil.rmtree(out)
    return result


def passed(r):
    return (
        r["code"] == 0
        and not r["problems"]
        and r["wall"] < GOAL_S
        and r["rss"] < GOAL_RSS
        and r["copied"] == 0
    )


COLUMNS = (
    ("model", "<"),
    ("ckpt GiB", ">"),
    ("shards", ">"),
    ("graphs", "<"),
    ("nodes", "<"),
    ("functions", "<"),
    ("ONNX MB", ">"),
    ("trace s", ">"),
    ("wall s", ">"),
    ("peak RSS MB", ">"),
    ("bytes copied", ">"),
    ("goal", "<"),
)


def row(r):
    ok = r["code"] == 0
    return (
        r["model"],
        f"{r['ckpt_gib']:.1f}",
        str(r["shards"]),
        "/".join(r["graphs"]) if ok else "-",
        "/".join(map(str, r["nodes"])) if ok else "-",
        "/".join(map(str, r["functions"])) if ok else "-",
        f"{r['onnx_mb']:.2f}" if ok else "-",
        f"{r['trace_s']:.1f}" if ok else "-",
        f"{r['wall']:.1f}",
        f"{r['rss'] / 1e6:.0f}",
        str(r["copied"]) if ok else "-",
        "PASS" if passed(r) else "FAIL",
    )


def table(results):
    rows = [tuple(c for c, _ in COLUMNS)] + [row(r) for r in results]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(f"{c:{a}{w}}" for c, (_, a), w in zip(r, COLUMNS, widths, strict=True)).rstrip()
        for r in rows
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument("--keep", type=Path, help="write checkpoints and exports here and keep them")
    p.add_argument("--seq-len", type=int, default=128, help="prefill chunk (default 128)")
    p.add_argument("--ctx-len", type=int, default=8192, help="KV cache length (default 8192)")
    p.add_argument(
        "--compare-inline",
        action="store_true",
        help="also export the first model with --no-subfunctions and compare",
    )
    args = p.parse_args()
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in CONFIGS]
    if unknown or not names:
        p.error(f"--models: unknown {unknown}; expected some of {', '.join(CONFIGS)}")
    root = Path(tempfile.mkdtemp(prefix="export-bench-")) if args.keep is None else args.keep
    root = root.resolve()
    results = []
    try:
        for name in names:
            print(f"{name}: exporting ...", file=sys.stderr, flush=True)
            results.append(bench(name, root, args))
        inline = None
        if args.compare_inline:
            print(f"{names[0]}: exporting inlined ...", file=sys.stderr, flush=True)
            inline = bench(names[0], root, args, ("--no-subfunctions",), names[0] + " inlined")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"seq_len {args.seq_len}, ctx_len {args.ctx_len}, budgets 280,1120; graphs, nodes and "
        "functions per graph; wall s = whole export process"
    )
    print(table(results))
    print(
        f"goal per model: < {GOAL_S:.0f} s, < {GOAL_RSS / 1e9:.1f} GB peak RSS, 0 bytes "
        "copied (QEfficient: 65-568 s per E2B graph)"
    )
    if inline is not None:
        print(f"\n{names[0]} with layers as ONNX functions vs inlined (--no-subfunctions)")
        print(table([results[0], inline]))
    for r in results + ([inline] if inline else []):
        for problem in r["problems"]:
            print(f"{r['model']}: {problem}")
    return 0 if all(passed(r) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
