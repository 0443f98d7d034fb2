"""The audio tower at the released E2B/E4B shapes (random weights): export, `verify` layer by
layer, packed clips against one clip at a time.

1. **Export** (`export_weight_free.bench`): the sparse checkpoint of each of `--models` (every
   parameter, the audio tower and embed_audio included: headers and holes), exported by one
   `python -m codegen export … --no-verify --no-hash` process with its vision, audio (budgets
   188 and 750, 4 clips), prefill and decode graphs; whole-process time, peak RSS, bytes
   copied. Goal: < 30 s, < 1.5 GB, 0 bytes copied.
2. **verify** of the audio graph layer by layer: a checkpoint of `--verify`'s config holding
   only the audio tower and embed_audio (`audio_param_shapes`), every tensor random bf16
   (`verify_full_size.write_checkpoint`), exported (the audio graph alone: the checkpoint has
   no text or vision tensors) and checked by `python -m codegen verify OUT` in a child process
   (1.15 GiB of float32 weights: layer by layer by default); its time, peak RSS (`os.wait4`'s
   `ru_maxrss`), worst error and where. Goal: peak RSS ≤ 8 GB.
3. **Packed vs one at a time**: `ref`'s `AudioTower` (jit-compiled `audio_forward`) on the same
   checkpoint, on the log-mel features of random clips of `--clips` seconds (default 30, 12, 5
   and 1.3: mixed lengths), all packed in one call against each clip in a call of its own, one
   after the other; each compiled and run once first, then `--runs` rounds, each timing both
   back to back (like with like on a machine whose load varies); the median and the ratio,
   and the largest difference between the two ways' soft tokens.

    python benchmarks/audio.py [--models E2B,E4B] [--verify E2B] [--clips 30,12,5,1.3]
        [--runs 5] [--keep DIR]

The machine's float32 matmul rate (`vision_packed_vs_padded.matmul_rate`: the faster of
torch.matmul and jnp.matmul on 4096² matrices), measured last, is printed with the tables.
The children's peak RSS counts the pages they were started with, a copy of this process's
(Linux carries the high-water mark across exec): torch, transformers and the tower are loaded
only after them (imported first, an export read 922 MB instead of 470). Exit status 0 when
every export and the verify met their goals.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import export_weight_free as ewf  # noqa: E402
from gemma4_configs import CONFIGS  # noqa: E402
from verify_full_size import GOAL_RSS, worst_per_graph, write_checkpoint  # noqa: E402

from codegen.graphs.audio import audio_param_shapes  # noqa: E402
from ref.gemma4.audio_config import AudioConfig  # noqa: E402
from ref.gemma4.audio_features import SAMPLE_RATE, log_mel  # noqa: E402
from ref.gemma4.audio_tower import AudioTower  # noqa: E402


def audio_checkpoint(folder, name):
    """A checkpoint of model `name`'s config holding only its audio tower and embed_audio,
    random bf16 (`verify_full_size.write_checkpoint`); -> bytes filled."""
    config = CONFIGS[name]
    shapes = audio_param_shapes(AudioConfig.from_hf(config))
    return write_checkpoint(folder, config, "all", shapes=shapes)


def verify_audio(name, root):
    """Write `audio_checkpoint`, export it and verify it in child processes; -> result dict
    (export and verify wall s and peak RSS bytes, exit codes, the worst row)."""
    model, out = root / f"{name}-audio-ckpt", root / f"{name}-audio-out"
    if not model.exists():
        audio_checkpoint(model, name)
    shutil.rmtree(out, ignore_errors=True)
    export = [sys.executable, "-m", "codegen", "export", "--model", str(model), "--out",
              str(out), "--no-verify", "--no-hash"]  # fmt: skip
    rc, export_s, export_rss = ewf.child(export, root / f"{name}-audio-export.log")
    result = {"model": name, "export_rc": rc, "export_s": export_s, "export_rss": export_rss}
    if rc:
        return {**result, "rc": rc, "log": ewf.tail(root / f"{name}-audio-export.log")}
    log = root / f"{name}-audio-verify.log"
    rc, wall, rss = ewf.child([sys.executable, "-m", "codegen", "verify", str(out)], log)
    text = log.read_text(errors="replace")
    layers = sum(" checked, " in line for line in text.splitlines())
    return {**result, "rc": rc, "verify_s": wall, "verify_rss": rss, "layer_calls": layers,
            "graphs": worst_per_graph(text), "log": ewf.tail(log, 8)}  # fmt: skip


def clip_features(seconds, seed=0):
    """([T_i, 128] log-mel features, [T_i] masks) of random clips of the given lengths."""
    rng = np.random.default_rng(seed)
    pairs = [log_mel(rng.uniform(-0.5, 0.5, round(s * SAMPLE_RATE)).astype(np.float32))
             for s in seconds]  # fmt: skip
    return [f for f, _ in pairs], [m for _, m in pairs]


def one_at_a_time(tower, features, masks):
    """Soft tokens of each clip encoded in a call of its own, concatenated: [Σ counts, D]."""
    return np.concatenate([tower.encode([f], [m])[0] for f, m in zip(features, masks, strict=True)])


def timed(fn):
    """(seconds, result) of fn()."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def packed_vs_single(folder, seconds, runs):
    """Times of the packed tower and of one clip at a time on clips of `seconds`; -> dict of
    the median seconds, every round's, the soft tokens per clip and the largest relative
    difference of the two ways' soft tokens."""
    tower = AudioTower.from_pretrained(folder)
    features, masks = clip_features(seconds)
    packed, counts = tower.encode(features, masks)  # compiles
    single = one_at_a_time(tower, features, masks)
    diff = float(np.max(np.abs(packed - single)) / np.max(np.abs(single)))
    rounds = []
    for _ in range(runs):
        a, _ = timed(lambda: tower.encode(features, masks))
        b, _ = timed(lambda: one_at_a_time(tower, features, masks))
        rounds.append((a, b))
    return {"packed": statistics.median(a for a, _ in rounds),
            "single": statistics.median(b for _, b in rounds), "rounds": rounds,
            "counts": list(counts), "diff": diff}  # fmt: skip


def verify_table(results):
    """Markdown rows of the audio verify results."""
    rows = ["| model | graph | worst rel err | output | where | ok | layer calls | verify s "
            "| peak RSS GB | export s |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        if r["rc"] and "graphs" not in r:
            rows.append(f"| {r['model']} | export failed (exit {r['rc']}) | | | | | | | | |")
            continue
        for g, (rel, output, where, ok) in r["graphs"].items():
            rows.append(
                f"| {r['model']} | {g} | {rel:.2e} | {output} | {where} | "
                f"{'ok' if ok and not r['rc'] else 'MISMATCH'} | {r['layer_calls']} | "
                f"{r['verify_s']:.0f} | {r['verify_rss'] / 1e9:.2f} | {r['export_s']:.1f} |"
            )
    return "\n".join(rows)


def timing_table(t, seconds):
    """The packed-vs-single lines."""
    spread = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in t["rounds"])
    return "\n".join([
        f"clips {', '.join(f'{s:g} s' for s in seconds)}: {sum(t['counts'])} soft tokens "
        f"({'+'.join(map(str, t['counts']))})",
        f"packed (one call)        {t['packed']:.2f} s (median of {len(t['rounds'])})",
        f"one clip at a time       {t['single']:.2f} s",
        f"ratio one-at-a-time / packed: {t['single'] / t['packed']:.2f}x; rounds packed/single "
        f"s: {spread}; soft tokens differ by {t['diff']:.1e} relative",
    ])  # fmt: skip


def matmul_rate():
    """(GFLOP/s, which) of `vision_packed_vs_padded.matmul_rate`, imported here: it loads
    torch and transformers (see the module)."""
    from vision_packed_vs_padded import matmul_rate as rate

    return rate()


def verify_ok(r):
    return not r["rc"] and r["verify_rss"] <= GOAL_RSS and all(g[3] for g in r["graphs"].values())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="E2B,E4B", help="export these (default E2B,E4B)")
    p.add_argument("--verify", default="E2B", help="verify these models' audio graphs")
    p.add_argument("--clips", default="30,12,5,1.3", help="clip lengths in seconds")
    p.add_argument("--runs", type=int, default=5, help="timed rounds (median)")
    p.add_argument("--seq-len", type=int, default=128, help="prefill chunk (default 128)")
    p.add_argument("--ctx-len", type=int, default=8192, help="KV cache length (default 8192)")
    p.add_argument("--keep", type=Path, help="write checkpoints and exports here and keep them")
    args = p.parse_args()
    names = [m for m in args.models.split(",") if m]
    checked = [m for m in args.verify.split(",") if m]
    audio = [m for m in CONFIGS if CONFIGS[m].get("audio_config") is not None]
    if not set(names + checked) <= set(audio) or not checked:
        p.error(f"--models, --verify: expected some of {', '.join(audio)} (with audio)")
    seconds = [float(s) for s in args.clips.split(",")]
    root = (args.keep or Path(tempfile.mkdtemp(prefix="audio-bench-"))).resolve()
    try:
        exported = []
        for name in names:
            print(f"{name}: exporting ...", file=sys.stderr, flush=True)
            exported.append(ewf.bench(name, root, args))
        verified = []
        for name in checked:
            print(f"{name}: audio verify ...", file=sys.stderr, flush=True)
            verified.append(verify_audio(name, root))
        print(f"{checked[0]}: packed vs one at a time ...", file=sys.stderr, flush=True)
        timing = packed_vs_single(root / f"{checked[0]}-audio-ckpt", seconds, args.runs)
        rate, which = matmul_rate()
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"matmul rate {rate:.0f} GFLOP/s ({which}, 4096²)\n")
    print(f"export (seq_len {args.seq_len}, ctx_len {args.ctx_len}, vision 280,1120, audio "
          "188,750 × 4 clips; whole process)")  # fmt: skip
    print(ewf.table(exported))
    print("\naudio graph verified layer by layer (budgets 188 and 750, random packings)")
    print(verify_table(verified))
    for r in verified:
        if r["rc"]:
            print(f"{r['model']}: exit {r['rc']}; log tail:\n{r['log']}")
    print(f"\naudio tower ({checked[0]}, ref AudioTower, jit), packed vs one clip at a time")
    print(timing_table(timing, seconds))
    for r in exported:
        for problem in r["problems"]:
            print(f"{r['model']}: {problem}")
    good = all(ewf.passed(r) for r in exported) and all(verify_ok(r) for r in verified)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
