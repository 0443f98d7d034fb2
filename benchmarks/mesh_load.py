"""Loading Gemma 4 at full size over a device mesh: bytes per device and host memory, 8 vs 1.

Writes a sparse checkpoint of a released model's shapes (`benchmarks/gemma4_configs.py`) cut to
its first `--layers` text layers — vision tower, embed_vision, token embeddings and those
layers, bf16, sharded as save_pretrained does; the data regions are holes
(`export_weight_free.write_sparse_checkpoint`), so no disk is used and reads return zeros.
Then, in a child process per mesh (the device count is fixed when jax starts, and each child's
peak memory must be its own), with `--xla_force_host_platform_device_count=N`:

    Gemma4.from_pretrained(ckpt, dtype=bfloat16, mesh=Mesh(devices, ("x",)))   # load
    model.generate(ids [1, seq_len], max_new_tokens=1)                         # one prefill

Measured per child:
- per-device bytes: the largest `ref.sharding.device_bytes` of the loaded parameters (text,
  lm head, vision tower, embed_vision) over the devices, and their sum over devices;
- host RSS: after imports (`base`), the high-water mark after loading (`peak load`,
  `ru_maxrss`) and after the prefill (`peak`, from `os.wait4` in the parent);
- load overhead: peak load − base − bytes on the devices (host devices live in host memory,
  so the placed weights count in RSS): what loading needed beyond the result. One device gets
  each tensor whole from its callback; on 8 devices a callback returns one block.

    python benchmarks/mesh_load.py [--model 31B] [--layers 2] [--devices 1,8] [--seq-len 16]
        [--keep DIR]
"""

import argparse
import copy
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GIB = 2**30


def first_layers(config, layers):
    """The config dict with its text decoder cut to the first `layers` layers."""
    config = copy.deepcopy(config)
    text = config["text_config"]
    if not 1 <= layers <= text["num_hidden_layers"]:
        raise SystemExit(f"--layers {layers}: expected 1..{text['num_hidden_layers']}")
    text["num_hidden_layers"] = layers
    text["layer_types"] = text["layer_types"][:layers]
    return config


def rss_peak():
    """This process's peak resident set size in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(ckpt, devices, seq_len):
    """Load and prefill on `devices` host devices; print one JSON line of measurements."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from ref import sharding
    from ref.gemma4.model import Gemma4

    base = rss_peak()
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    start = time.perf_counter()
    model = Gemma4.from_pretrained(ckpt, dtype=jnp.bfloat16, mesh=mesh)
    arrays = [model.params, model.lm_head, model.vision.params, model.vision.embed_params]
    jax.block_until_ready(arrays)
    load_s = time.perf_counter() - start
    peak_load = rss_peak()
    held = sharding.device_bytes(arrays)
    start = time.perf_counter()
    ids = np.random.default_rng(0).integers(3, 1000, size=(1, seq_len))
    tokens = model.generate(ids, max_new_tokens=1)
    prefill_s = time.perf_counter() - start
    unsplit = sharding.unsplit(model.params, mesh, "model.language_model.")
    print(
        json.dumps(
            dict(
                devices=devices,
                load_s=load_s,
                prefill_s=prefill_s,
                per_device=max(held.values()),
                total=sum(held.values()),
                base=base,
                peak_load=peak_load,
                token=int(tokens[0, 0]),
                unsplit=sorted(unsplit),
            )
        )
    )


def run_child(ckpt, devices, seq_len):
    """One child process; -> its measurements plus `peak` (its ru_maxrss from os.wait4)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    cmd = [sys.executable, __file__, "--child", str(ckpt), "--devices", str(devices)]
    cmd += ["--seq-len", str(seq_len)]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        text = out.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{devices} devices: child failed\n{text}")
    result = json.loads(text.strip().splitlines()[-1])
    result["peak"] = usage.ru_maxrss * 1024
    return result


def table(rows, logical):
    head = (
        f"{'devices':>7} {'load s':>7} {'prefill s':>9} {'per device GiB':>14} "
        f"{'all devices GiB':>15} {'base GiB':>8} {'peak load GiB':>13} {'overhead GiB':>12} "
        f"{'peak GiB':>8}"
    )
    lines = [f"checkpoint: {logical / GIB:.2f} GiB of bf16 weights", head]
    for r in rows:
        overhead = r["peak_load"] - r["base"] - r["total"]
        lines.append(
            f"{r['devices']:>7} {r['load_s']:>7.1f} {r['prefill_s']:>9.1f} "
            f"{r['per_device'] / GIB:>14.3f} {r['total'] / GIB:>15.2f} {r['base'] / GIB:>8.2f} "
            f"{r['peak_load'] / GIB:>13.2f} {overhead / GIB:>12.2f} {r['peak'] / GIB:>8.2f}"
        )
    one, many = rows[0], rows[-1]
    overhead = [r["peak_load"] - r["base"] - r["total"] for r in (one, many)]
    lines.append(
        f"{many['devices']} vs {one['devices']}: per-device bytes "
        f"×{many['per_device'] / one['per_device']:.3f}, load overhead "
        f"×{overhead[1] / max(1, overhead[0]):.3f}"
    )
    for r in rows:
        if r["unsplit"]:
            lines.append(f"{r['devices']} devices: replicated (dim not divisible): {r['unsplit']}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="31B")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--devices", default="1,8")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--keep", type=Path, help="folder for the sparse checkpoint (kept)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, int(args.devices), args.seq_len)

    from export_weight_free import write_sparse_checkpoint
    from gemma4_configs import CONFIGS

    config = first_layers(CONFIGS[args.model], args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        folder = (args.keep or Path(tmp)) / f"{args.model}-{args.layers}layers"
        logical, shards = write_sparse_checkpoint(folder, config)
        rows = [run_child(folder, int(n), args.seq_len) for n in args.devices.split(",")]
    print(f"{args.model}, first {args.layers} layers, {shards} shards, prefill of {args.seq_len}")
    print(table(rows, logical))


if __name__ == "__main__":
    main()
