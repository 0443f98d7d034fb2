"""Prefill attention at S = T = 8k and 16k (H=8, Hkv=2, D=128, float32): dense vs blocked modes.

Two memory figures per mode: XLA's compiled temp allocation (`memory_analysis()
.temp_size_in_bytes`: all the program allocates besides inputs and outputs, as XLA:CPU schedules
it) and the algorithm's working set, the largest score block `H · S_blk · T_blk · 4` bytes (what
a blocked kernel holds at once). Time is the best of `--repeat` runs (the first run included).
A mode whose temp memory exceeds `--max-gib` is compiled but not run. Blocked modes run with
`ordered=True` (each block waits for the previous one) unless `--unordered`.
Usage: `python -m benchmarks.attention_blocking [--sizes 8192 16384] [--repeat 1]`.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ref.attention import blocked, reference

H, HKV, D = 8, 2, 128


def score_block_bytes(name, n, blocks):
    """Largest score block of a mode: H · S_blk · T_blk float32 values."""
    blk = -(-n // blocks)
    s_blk = n if name in ("dense", "kv") else blk
    t_blk = n if name == "dense" else blk
    return H * s_blk * t_blk * 4


def modes(blocks, ordered):
    """name → attention function of (q, k, v, q_pos, kv_pos); `blocks` cuts queries and cache."""
    opts = dict(ordered=ordered)
    return {
        "dense": reference,
        "kv": lambda *a: blocked(*a, mode="kv", num_kv_blocks=blocks, **opts),
        "qkv": lambda *a: blocked(
            *a, mode="qkv", num_q_blocks=blocks, num_kv_blocks=blocks, **opts
        ),
        "online": lambda *a: blocked(
            *a,
            mode="prefill_online",
            prefill_block_chunks=blocks,
            num_kv_blocks=blocks,
            skip_kv=True,
            **opts,
        ),
    }


def measure(fn, args, repeat, max_bytes):
    """(temp bytes, compile s, best run s or None when it would not fit)."""
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    if temp > max_bytes:
        return temp, compile_s, None
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        compiled(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return temp, compile_s, best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--blocks", type=int, default=8, help="query and KV block count")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--max-gib", type=float, default=12.0, help="skip runs needing more")
    parser.add_argument("--check", action="store_true", help="also compare to dense (max err)")
    parser.add_argument(
        "--unordered", action="store_true", help="blocked modes without ordered=True"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for n in args.sizes:
        q = jnp.asarray(rng.normal(size=(1, H, n, D)) / np.sqrt(D), jnp.float32)
        k = jnp.asarray(rng.normal(size=(1, HKV, n, D)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(1, HKV, n, D)), jnp.float32)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        inputs = (q, k, v, pos, pos)
        dense_out = None
        for name, fn in modes(args.blocks, not args.unordered).items():
            temp, compile_s, run_s = measure(fn, inputs, args.repeat, args.max_gib * 2**30)
            err = None
            if args.check and run_s is not None:
                out = jax.jit(fn)(*inputs)
                if name == "dense":
                    dense_out = out
                elif dense_out is not None:
                    err = float(jnp.abs(out - dense_out).max() / jnp.abs(dense_out).max())
            rows.append(
                (n, name, temp, score_block_bytes(name, n, args.blocks), compile_s, run_s, err)
            )
            print(f"  measured S=T={n} {name}: {temp / 2**20:.0f} MiB, run {run_s}", flush=True)
    print_table(rows, args.blocks, not args.unordered)


def print_table(rows, blocks, ordered):
    dense = {r[0]: r for r in rows if r[1] == "dense"}
    print(
        f"\nprefill S = T, H={H}, Hkv={HKV}, D={D}, float32, {blocks} query / KV blocks, "
        f"ordered={ordered}"
    )
    print(
        f"{'S=T':>6} {'mode':>7} {'XLA temp MiB':>12} {'/dense':>7} {'scores MiB':>10}"
        f" {'/dense':>7} {'time s':>8} {'/dense':>7} {'compile s':>9} {'rel err':>8}"
    )
    for n, name, temp, scores, compile_s, run_s, err in rows:
        _, _, d_temp, d_scores, _, d_run, _ = dense[n]
        time_s = f"{run_s:.2f}" if run_s is not None else "skipped"
        time_ratio = f"{run_s / d_run:.2f}" if run_s is not None and d_run else "-"
        err_s = f"{err:.1e}" if err is not None else "-"
        print(
            f"{n:>6} {name:>7} {temp / 2**20:>12.0f} {temp / d_temp:>7.3f} {scores / 2**20:>10.0f}"
            f" {scores / d_scores:>7.4f} {time_s:>8} {time_ratio:>7} {compile_s:>9.1f} {err_s:>8}"
        )


if __name__ == "__main__":
    main()
