"""Bytes between host and device when serving, at the released shapes: what the runtime moves
under the device's rules (`codegen.run.device`), one language program against two.

For E2B, E4B and 31B (Google's released config.json, read from ../shared/gemma4/configs/: the
benchmark refuses to run without it) it writes a sparse checkpoint (headers and holes,
`export_weight_free.write_sparse_checkpoint`) and exports it with 4 continuous-batching slots
(`--budgets 280 --full-batch-size 4 --no-verify --no-hash`, each in a child process: its wall
time against the 30 s goal) four ways:

    default, split:          --seq-len 128 --ctx-len 8192 --split-programs
    default, one program:    --seq-len 128 --ctx-len 8192
    production, split:       --seq-len 1024 --ctx-len 65536 and QEfficient's production
                             blocking (`export_production.PRODUCTION`: prefill qkv, decode
                             kv_headpar, which cannot be one program)
    production, one program: --seq-len 1024 --ctx-len 65536, dense attention

Each export then serves 8 text requests of mixed lengths arriving over the first steps
(REQUESTS) through `codegen.run.runtime.Runner.serve` on `ShapeOnly` engines: every call the
runtime makes, at its real shapes, computing nothing (the bytes depend on the shapes and the
schedule only; the tokens are all id 0, and no request stops early).

Per export it prints the bytes in and out per request and per generated token: the KV cache
(retained state, float16 as custom_io.yaml gives it), logits, everything else.

    python benchmarks/device_transfers.py [--models E2B,E4B,31B] [--options default,production]
        [--keep DIR]
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from export_production import PRODUCTION  # noqa: E402
from export_weight_free import child, write_sparse_checkpoint  # noqa: E402

from codegen.run.device import WHAT, ShapeOnly  # noqa: E402
from codegen.run.runtime import Request, Runner  # noqa: E402

CONFIGS = ROOT.parent / "shared" / "gemma4" / "configs"
MODELS = ("E2B", "E4B", "31B")
OPTIONS = {
    "default": ("--seq-len", "128", "--ctx-len", "8192"),
    "production": ("--seq-len", "1024", "--ctx-len", "65536"),
}
LAYOUTS = {  # (options, layout) → what the export is given besides OPTIONS
    ("default", "split"): ("--split-programs",),
    ("default", "one program"): (),
    ("production", "split"): PRODUCTION,
    ("production", "one program"): (),
}
SLOTS = 4
# (prompt tokens, new tokens, arrival step) of the 8 requests
REQUESTS = ((300, 64, 0), (1500, 32, 0), (90, 128, 0), (2600, 16, 1), (700, 48, 3),
            (40, 96, 5), (1200, 24, 8), (500, 64, 12))  # fmt: skip
GOAL_S = 30.0


def released_config(model):
    """Google's config.json of `model`-it, from ../shared/gemma4/configs/."""
    path = CONFIGS / f"{model}-it.config.json"
    if not path.is_file():
        sys.exit(f"{path}: not found. This benchmark reads Google's released config.json files "
                 "from ../shared/gemma4/configs/ (beside the repository); without them it does "
                 "not run.")  # fmt: skip
    return json.loads(path.read_text())


def served(out):
    """The runtime's transfers serving REQUESTS over the export `out` (`ShapeOnly` engines)
    → (Transfers, generated tokens)."""
    runner = Runner(out, check_shards=False, engine=ShapeOnly)
    rng = np.random.default_rng(0)
    requests = [Request(rng.integers(10, 1000, n), [], new, arrival)
                for n, new, arrival in REQUESTS]  # fmt: skip
    tokens, _ = runner.serve(requests, stop=())
    return runner.transfers, sum(len(t) for t in tokens)


def row(model, option, layout, transfers, tokens):
    """A table row: KV in and out, logits out, other in, per request then per token (MB)."""
    total = {(d, w): transfers.total(w, d) for d in ("in", "out") for w in WHAT}
    cells = [f"{total[(d, w)] / scale / 1e6:,.3f}"
             for scale in (len(REQUESTS), tokens) for d, w in
             (("in", "kv"), ("out", "kv"), ("out", "logits"), ("in", "other"))]  # fmt: skip
    return [model, option, layout, *cells]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--options", default=",".join(OPTIONS))
    parser.add_argument("--keep", type=Path, help="keep the checkpoints and exports here")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="device-transfers-"))
    table, times = [], []
    try:
        for model in args.models.split(","):
            ckpt = root / f"{model}-ckpt"
            write_sparse_checkpoint(ckpt, released_config(model))
            for (option, layout), extra in LAYOUTS.items():
                if option not in args.options.split(","):
                    continue
                name = f"{model}-{option}-{layout.replace(' ', '-')}"
                cmd = [sys.executable, "-m", "codegen", "export", "--model", str(ckpt),
                       "--out", str(root / name), "--budgets", "280", "--full-batch-size",
                       str(SLOTS), "--no-verify", "--no-hash", "--force", *OPTIONS[option],
                       *extra]  # fmt: skip
                code, wall, _ = child(cmd, root / f"{name}.log")
                if code:
                    sys.exit(f"export failed: see {root / f'{name}.log'}")
                times.append((name, wall))
                transfers, tokens = served(root / name)
                table.append(row(model, option, layout, transfers, tokens))
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    head = ["model", "options", "layout"] + [
        f"{w} {d} /{per}"
        for per in ("req", "token")
        for d, w in (("in", "KV"), ("out", "KV"), ("out", "logits"), ("in", "other"))
    ]
    print(f"{len(REQUESTS)} requests over {SLOTS} slots, MB (1e6 bytes); KV as float16")
    widths = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    for r in [head, *table]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    print(
        "export (child process wall s, goal < 30 s): "
        + ", ".join(f"{n} {w:.1f} s" + ("" if w < GOAL_S else " (missed)") for n, w in times)
    )


if __name__ == "__main__":
    main()
