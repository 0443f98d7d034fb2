"""Weight-free export at full size: wall time, peak RSS, .onnx sizes, weight bytes copied.

A sparse checkpoint (real safetensors header, data region a hole: no byte written) with the
31B-shape vision tower (27 layers, 1152 hidden, 16 heads of 72, FFN 4304, standardize,
position table 10240, embed_vision to a 5376-wide text model) and the first 16 of the 31B's
60 text attention layers (5376 hidden, 32 query heads; sliding layers 16 kv heads of 256,
full layers 5 and 11 with 4 kv heads of 512, values = keys, q/k norms). One `export`
writes the vision graph with budgets 280 and 1120 and a 16-layer Gemma 4 text attention
stack at ctx_len 8192 (kv blocking).
Goal: under 20 s in all and under 1 GB peak RSS on a 2-core machine, 0 bytes copied;
QEfficient publishes 65–568 s per graph for Gemma 4 E2B.

    python benchmarks/export_weight_free.py [--keep DIR]
"""

import argparse
import dataclasses
import json
import math
import os
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from codegen.export import ExportOptions, export  # noqa: E402
from codegen.graphs import (  # noqa: E402
    EMBED_VISION,
    attention_param_shapes,
    text_config,
    vision_param_shapes,
)
from ref.gemma4.config import VisionConfig  # noqa: E402

VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 72,
    "patch_size": 16,
    "pooling_kernel_size": 3,
    "position_embedding_size": 10240,
    "use_clipped_linears": False,
    "standardize": True,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}
TEXT = {
    "model_type": "gemma4_text",
    "hidden_size": 5376,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 16,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 4,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "use_bidirectional_attention": "vision",
}
TEXT_LAYERS = 16  # tensors of the first 16 layers only: the attention stack's depth
CONFIG = {"model_type": "gemma4", "vision_config": VISION, "text_config": TEXT}


def tensor_shapes():
    """{name: shape} of every tensor the benchmark's graphs read."""
    shapes = {
        "model.vision_tower." + n: s
        for n, s in vision_param_shapes(VisionConfig.from_hf(CONFIG)).items()
    }
    shapes[EMBED_VISION] = (TEXT["hidden_size"], VISION["hidden_size"])
    text = text_config(CONFIG)
    for i in range(TEXT_LAYERS):
        shapes.update(attention_param_shapes(text, i))
    return shapes


def write_sparse_checkpoint(folder):
    """config.json + model.safetensors whose data region is a hole (bf16 sizes)."""
    header, offset = {}, 0
    for name, shape in sorted(tensor_shapes().items()):
        nbytes = 2 * math.prod(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return offset


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keep", type=Path, help="write here instead of a temporary folder")
    p.add_argument(
        "--compare-inline",
        action="store_true",
        help="then export again with --no-subfunctions and print both",
    )
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="export-bench-")) if args.keep is None else args.keep
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    data_bytes = write_sparse_checkpoint(model)
    opts = ExportOptions(
        out=root / "export",
        model=model,
        budgets=(280, 1120),
        blocking=(("kv", {"num_kv_blocks": 4}),),
        batch_size=1,
        seq_len=128,
        ctx_len=8192,
        hash_shards=False,
        verify=False,
        force=True,
    )
    start = time.perf_counter()
    manifest = export(opts, log=lambda m: print(m, file=sys.stderr))
    wall = time.perf_counter() - start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"checkpoint: {data_bytes / 2**30:.2f} GiB of bf16 weights (sparse file)")
    print(f"{'graph':<16}{'specializations':<26}{'trace s':>8}{'.onnx MB':>10}{'weights':>9}")
    for g in manifest["graphs"]:
        specs = ",".join(s["name"] for s in g["specializations"])
        print(
            f"{g['name']:<16}{specs:<26}{g['trace_s']:>8.1f}"
            f"{g['onnx_bytes'] / 1e6:>10.2f}{len(g['weights']):>9}"
        )
    print(f"export wall time {wall:.1f} s (goal < 20 s; QEfficient: 65-568 s per graph)")
    print(f"peak RSS {peak_mb:.0f} MB (goal < 1024 MB)")
    print(f"weight bytes copied: {manifest['bytes_copied']} (must be 0)")
    if args.compare_inline:
        inline_opts = dataclasses.replace(opts, out=root / "inline", sub_functions=False)
        start = time.perf_counter()
        inline = export(inline_opts, log=lambda m: print(m, file=sys.stderr))
        inline_wall = time.perf_counter() - start
        print(
            f"{'layers as':<16}{'export s':>9}"
            + "".join(f"{g['name'] + ' MB':>18}" for g in manifest["graphs"])
        )
        for label, m, w in (("ONNX functions", manifest, wall), ("inlined", inline, inline_wall)):
            print(
                f"{label:<16}{w:>9.1f}"
                + "".join(f"{g['onnx_bytes'] / 1e6:>18.2f}" for g in m["graphs"])
            )
    return 0 if manifest["bytes_copied"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
