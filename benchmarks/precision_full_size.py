"""`verify --precision fp16` of a released-shape vision tower on one host: the standardize
overflow of the 31B and 26B-A4B towers (vLLM #40290, #40347) caught by name, and gone with
`export --clip-fp16`.

The benchmark writes the tower of a released config (`benchmarks/gemma4_configs.py`, default
31B) as a checkpoint of its own (config.json with its vision_config, bf16 tensors): random
weights (normal, std 0.02; norm scales near 1), `std_bias` at the released magnitudes on a
few channels (−53,760 and +36,352, as reported in vLLM #40347; 0 elsewhere) and `std_scale`
1e-4 there (1 elsewhere), and the last layer's `post_feedforward_layernorm` scaled by
`--feature-scale` so that the pooled features reach the ~1e4 magnitudes that make
h − std_bias pass 65,504 in the released models (random weights alone give features near 1).
It exports the tower twice (`--budgets 280 --no-verify`, plain and `--clip-fp16`) and runs,
in a child process each,

    python -m codegen verify OUT --precision fp16

which goes layer by layer (the tower's float32 weights exceed 256 MiB). Measured: exit
status, the first non-finite tensor named (ref and onnx), the largest |x| before the
standardize step, wall seconds and peak RSS (`os.wait4`) of each run.

Goal (issue 23): the plain export is refused naming the standardize subtraction; the clipped
one passes; each run in bounded memory on a 24 GB host (issue 41: each in ≤ 15 min and
≤ 8 GB). `--plan` instead writes the plain export's node-precision plan and checks it;
`--whole-model` audits the whole model at the issue's shapes (sparse text layers); `verify
--precision` checks each graph in a process of its own there, so memory is also reported as
the peak of all the processes' summed proportional set size (`tree_pss`, sampled twice a
second), and the goal is judged on the larger of the two figures.

    python benchmarks/precision_full_size.py [--model 31B] [--budget 280]
        [--feature-scale 400] [--plan | --whole-model] [--keep DIR]
"""

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from export_weight_free import child, tree_child, write_sparse_checkpoint  # noqa: E402
from gemma4_configs import CONFIGS  # noqa: E402
from verify_full_size import _scale_of  # noqa: E402

from ref.gemma4.params import vision_param_shapes  # noqa: E402
from ref.gemma4.vision import VisionConfig  # noqa: E402
from weights import open_checkpoint, save_checkpoint  # noqa: E402

RELEASED_BIAS = (-53760.0, 36352.0)  # vLLM #40347: std_bias on some channels (31B, 26B-A4B)
BIASED_CHANNELS = 8  # channels given each released value


def tower_tensors(config, feature_scale, seed=0):
    """{name: bf16 array} of the tower of `config` (see the module docstring)."""
    cfg = VisionConfig.from_hf(config)
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in sorted(vision_param_shapes(cfg).items()):
        mean, std = _scale_of(name)
        x = rng.standard_normal(shape, dtype=np.float32) * std + mean
        out[name] = x
    bias = np.zeros(cfg.hidden_size, np.float32)
    scale = np.ones(cfg.hidden_size, np.float32)
    channels = rng.choice(cfg.hidden_size, 2 * BIASED_CHANNELS, replace=False)
    for i, value in enumerate(RELEASED_BIAS):
        picked = channels[i * BIASED_CHANNELS : (i + 1) * BIASED_CHANNELS]
        bias[picked], scale[picked] = value, 1e-4
    out["std_bias"], out["std_scale"] = bias, scale
    last = f"encoder.layers.{cfg.num_hidden_layers - 1}.post_feedforward_layernorm.weight"
    out[last] = out[last] * feature_scale
    return {n: x.astype(ml_dtypes.bfloat16) for n, x in out.items()}


def first_bad(text):
    """The report's lines naming a non-finite tensor."""
    return [line for line in text.splitlines() if "turns non-finite" in line]


def peak_before_standardize(text):
    """The largest |x| the report gives for the tower's own module (pooler and standardize)."""
    found = re.findall(r"^vision\s+\S+\s+VisionModel\s+(\S+)", text, re.M)
    return max((float(x) for x in found), default=float("nan"))


def export_tower(root, ckpt, args, clip):
    """The tower exported under `root` (once; kept) → its folder."""
    out = root / f"{args.model}-tower-{'clipped' if clip else 'plain'}"
    if not (out / "manifest.json").exists():
        cmd = [sys.executable, "-m", "codegen", "export", "--model", str(ckpt)]
        cmd += ["--out", str(out), "--budgets", str(args.budget), "--no-verify"]
        rc, _, _ = child(cmd + (["--clip-fp16"] if clip else []), root / "export.log")
        if rc:
            sys.exit(f"export failed (rc {rc}), see {root / 'export.log'}")
    return out


def plan(root, ckpt, args):
    """`verify --precision fp16 --write-npi` of the plain export in a child: its plan (the
    node outputs kept in float32, each paired with `ref`'s tensor), wall seconds and peak
    RSS; then `verify --precision fp16` honouring it (both device models should stay
    finite)."""
    out = export_tower(root, ckpt, args, clip=False)
    log = root / "plan.log"
    cmd = [sys.executable, "-m", "codegen", "verify", str(out), "--precision", "fp16"]
    rc, wall, rss = child([*cmd, "--write-npi"], log)
    text = log.read_text(errors="replace")
    kept = [line.strip() for line in text.splitlines() if line.startswith("  vision_")]
    summary = next((line for line in text.splitlines() if "node(s) in float32" in line), "-")
    print("| export | verify --precision fp16 --write-npi | plan | kept | wall | peak RSS |")
    print("|---|---|---|---|---|---|")
    print(f"| plain | exit {rc} | {summary} | {'; '.join(kept) or '-'} | {wall:.0f} s | "
          f"{rss / 1e9:.2f} GB |")  # fmt: skip
    checked = root / "precision-planned.log"
    rc2, wall, rss = child(cmd, checked)
    bad = first_bad(checked.read_text(errors="replace"))
    print(f"\nwith the plan: `verify --precision fp16` exit {rc2}, {'; '.join(bad) or 'finite'}, "
          f"{wall:.0f} s, {rss / 1e9:.2f} GB")  # fmt: skip
    return rc or rc2


def whole_model(root, args):
    """The whole model's audit, as issue 41 tried it: a checkpoint of the released config that
    is sparse (holes read as zeros) but for the vision tower (`tower_tensors`), exported at
    seq_len 128, ctx_len 1,024 and `--budget`, and `verify OUT --precision fp16 --no-npi` on
    every graph in a child: exit status, the first non-finite tensors, wall and peak RSS."""
    config = CONFIGS[args.model]
    ckpt, out = root / f"{args.model}-whole", root / f"{args.model}-whole-out"
    if not (ckpt / "config.json").exists():
        write_sparse_checkpoint(ckpt, config)
        tensors = open_checkpoint(ckpt).tensors
        for name, x in tower_tensors(config, args.feature_scale).items():
            info = tensors[f"model.vision_tower.{name}"]
            with open(info.file, "r+b") as f:
                f.seek(info.offset)
                f.write(x.tobytes())
    if not (out / "manifest.json").exists():
        cmd = [sys.executable, "-m", "codegen", "export", "--model", str(ckpt), "--out", str(out),
               "--budgets", str(args.budget), "--seq-len", "128", "--ctx-len", "1024",
               "--no-verify", "--no-hash"]  # fmt: skip
        rc, _, _ = child(cmd, root / "export-whole.log")
        if rc:
            sys.exit(f"export failed (rc {rc}), see {root / 'export-whole.log'}")
    log = root / "precision-whole.log"
    cmd = [sys.executable, "-m", "codegen", "verify", str(out), "--precision", "fp16", "--no-npi"]
    rc, wall, rss, tree = tree_child(cmd, log)
    bad = first_bad(log.read_text(errors="replace"))
    print("| export | verify --precision fp16 | first non-finite | wall | peak RSS, one process "
          "| peak PSS, all its processes |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| {args.model} shape, whole model | exit {rc} | {'; '.join(bad) or '-'} | "
          f"{wall:.0f} s | {rss / 1e9:.2f} GB | {tree / 1e9:.2f} GB |")  # fmt: skip
    return 0 if rc == 1 and wall <= 15 * 60 and max(rss, tree) <= 8e9 else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="31B", choices=sorted(CONFIGS))
    p.add_argument("--budget", type=int, default=280)
    p.add_argument("--feature-scale", type=float, default=400.0)
    p.add_argument("--keep", type=Path, help="keep the checkpoint and exports here")
    p.add_argument("--whole-model", action="store_true",
                   help="instead: the whole model's audit (sparse text layers, this tower), "
                        "exported at seq_len 128, ctx_len 1,024")  # fmt: skip
    p.add_argument("--plan", action="store_true",
                   help="instead: `verify OUT --precision fp16 --write-npi` on the plain export "
                        "(the node-precision plan, searched layer by layer)")  # fmt: skip
    args = p.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="precision_full_size."))
    root.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[args.model]
    if "vision_config" not in config or not config["vision_config"].get("standardize"):
        sys.exit(f"{args.model}: its tower has no standardize step (nothing to overflow)")
    try:
        if args.whole_model:
            return whole_model(root, args)
        ckpt = root / f"{args.model}-tower"
        if not (ckpt / "config.json").exists():
            tensors = tower_tensors(config, args.feature_scale)
            save_checkpoint(ckpt, dict(config["vision_config"]), tensors)
            gib = sum(x.nbytes for x in tensors.values()) / 2**30
            print(f"{args.model} tower: {len(tensors)} tensors, {gib:.2f} GiB bf16", flush=True)
            del tensors
        if args.plan:
            return plan(root, ckpt, args)
        rows = []
        for clip in (False, True):
            out = export_tower(root, ckpt, args, clip)
            log = root / f"precision-{'clipped' if clip else 'plain'}.log"
            # as compiled without a plan, whatever `--plan` wrote beside the export
            cmd = [sys.executable, "-m", "codegen", "verify", str(out), "--precision", "fp16",
                   "--no-npi"]  # fmt: skip
            rc, wall, rss = child(cmd, log)
            text = log.read_text(errors="replace")
            rows.append((clip, rc, wall, rss, first_bad(text), peak_before_standardize(text)))
            print(f"{'clipped' if clip else 'plain'}: rc {rc}, {wall:.0f} s, "
                  f"{rss / 1e9:.2f} GB", flush=True)  # fmt: skip
        print()
        print("| export | verify --precision fp16 | first non-finite | max |x| VisionModel | "
              "wall | peak RSS |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for clip, rc, wall, rss, bad, peak in rows:
            print(
                f"| {'--clip-fp16' if clip else 'plain'} | exit {rc} | "
                f"{'; '.join(bad) or '-'} | {peak:.4g} | {wall:.0f} s | {rss / 1e9:.2f} GB |"
            )
        ok = rows[0][1] == 1 and any("sub" in b for b in rows[0][4]) and rows[1][1] == 0
        print(f"\ngoal (plain refused naming the subtraction, clipped passes): "
              f"{'met' if ok else 'NOT met'}")  # fmt: skip
        return 0 if ok else 1
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
