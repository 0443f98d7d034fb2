#!/usr/bin/env bash
# Regenerates docs/img/*.png, the schedule pictures of docs/blocking.md: for each picture one
# `python -m codegen plan ... --png docs/img/NAME.png` (run in one Python process, so JAX and
# matplotlib load once). Usage: tools/pictures.sh   (PYTHON=... to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-.venv/bin/python}" - <<'PY'
import contextlib
import io
import shlex

from codegen.__main__ import main

# One kv head serving two query heads, a chunk of 8 queries at positions 8..15 of a 16-slot
# linear cache; pictures that need a batch or more heads say so after these.
SIZES = "--batch 1 --heads 2 --kv-heads 1 --seq 8 --ctx 16 --head-dim 8"
PICTURES = {
    "dense": "--mode dense",
    "kv": "--mode kv --opt num_kv_blocks=4",
    "q": "--mode q --opt num_q_blocks=2",
    "h": "--mode h --opt head_block_size=1",
    "qkv": "--mode qkv --opt num_q_blocks=2 --opt num_kv_blocks=4",
    "hq": "--mode hq --opt head_block_size=1 --opt num_q_blocks=2",
    "hkv": "--mode hkv --opt head_block_size=1 --opt num_kv_blocks=4",
    "hqkv": "--mode hqkv --opt head_block_size=1 --opt num_q_blocks=2 --opt num_kv_blocks=4",
    "bhqkv": "--mode bhqkv --batch 2 --opt num_batch_blocks=2 --opt head_block_size=2 "
    "--opt num_q_blocks=2 --opt num_kv_blocks=4",
    "kv_headpar": "--mode kv --opt num_kv_blocks=2 --opt headpar_split=2",
    "kv_batch_fold": "--mode kv --batch 2 --opt num_kv_blocks=4 --opt batch_fold=true",
    "prefill_q": "--mode prefill_q --opt prefill_block_chunks=2",
    "prefill_kv": "--mode prefill_kv --opt num_kv_blocks=4",
    "prefill_qkv": "--mode prefill_qkv --opt prefill_block_chunks=2 --opt num_kv_blocks=4",
    "prefill_online": "--mode prefill_online --opt prefill_block_chunks=2 --opt num_kv_blocks=4 "
    "--opt prefill_n_rep_chunk=1",
    "sliding_vision_skip": "--mode qkv --opt num_q_blocks=2 --opt num_kv_blocks=4 "
    "--opt skip_kv=true --opt sliding_window=6 --opt vision=3 --opt vision_offset=2",
}
# MoE (its own sizes: 8 tokens, 4 experts, top 2); nsp with 6 tokens crowding expert 0
PICTURES |= {
    "moe_gather": "--op moe --mode gather",
    "moe_nsp": "--op moe --mode nsp --opt hot=6",
}
# The audio tower's chunked attention (its own sizes): clips of 120, 64 and 80 frames and a
# frame budget with room for a fourth clip (filler tokens and chunks), the released chunking
PICTURES["audio_chunked"] = "--op audio_attention --opt frame_budget=280 --opt max_clips=4"
for name, args in PICTURES.items():
    sizes = [] if name.startswith(("moe_", "audio_")) else shlex.split(SIZES)
    argv = ["plan", *sizes, *shlex.split(args), "--png", f"docs/img/{name}.png"]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rc = main(argv)
    if rc:
        raise SystemExit(f"{name}: python -m codegen {shlex.join(argv)} exited {rc}")
    print(printed.getvalue().splitlines()[-1])
PY
