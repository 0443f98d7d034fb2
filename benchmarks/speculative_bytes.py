"""Speculative decoding with the MTP assistant at the released shapes: export time, and the weight
bytes one speculate call reads (the target's step over K + 1 tokens and K drafter steps)
against K + 1 decode calls, counted from the exported graphs.

For E2B and 31B (`benchmarks/gemma4_configs.py`) and their assistants (second-hand shapes, see
ASSISTANTS: what ../shared/DESIGN.md records; the rest assumed and named so) the benchmark
writes sparse checkpoints (`export_weight_free.write_sparse_checkpoint`: headers and holes, no
weight byte on disk), exports

    python -m codegen export --model T --assistant A --num-speculative-tokens K --decode-only \\
        --budgets "" --ctx-len 8192 --no-verify --no-hash

in a child process (wall time: < 30 s the goal), and counts from decode.onnx and speculate.onnx
the bytes of checkpoint weight each call reads (`reads`): an initializer's whole bytes per node
or function call that reads it, through its casts, transposes and reshapes (a layer's weights
once per call of its layer function: the drafter's layers and head K times a round), and for a
Gather of it (embeddings, the centroid head's rows, token_ordering's) the rows gathered (the
Gather's indices, from ONNX shape inference at the graph's specialization). A device streams
a large model's weights from DRAM on every use, so these are the bytes a call moves; a drafter
small enough to stay on chip moves fewer.

Then, at published acceptance (31B, K = 7: 5.37 tokens per round, vLLM #41745; 26B-A4B, K = 4:
per position 0.84 / 0.60 / 0.39 / 0.27, so 3.10 tokens per round, E2B's stand-in), tokens per
GB of weights read: plain decode (1 token per decode call) against speculation (tokens per
round / bytes per round).

    python benchmarks/speculative_bytes.py [--models E2B,31B] [--keep DIR]
"""

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import onnx
from onnx import shape_inference

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from export_weight_free import child, write_sparse_checkpoint, write_sparse_shard  # noqa: E402
from gemma4_configs import CONFIGS  # noqa: E402

from ref.gemma4.assistant import AssistantConfig, param_shapes  # noqa: E402

GOAL_S = 30.0
TARGET_KEYS = ("vocab_size", "head_dim", "global_head_dim", "num_key_value_heads",
               "num_global_key_value_heads", "attention_k_eq_v", "sliding_window",
               "rope_parameters")  # fmt: skip
# (drafts K, published tokens per round at K, where from)
ACCEPTANCE = {
    "E2B": (4, 1 + 0.84 + 0.60 + 0.39 + 0.27, "26B-A4B's per-position rates (a stand-in)"),
    "31B": (7, 5.37, "vLLM #41745"),
}
# The assistants' shapes: recorded second-hand (../shared/DESIGN.md) where named; "assumed"
# values are ours (intermediate sizes, 31B's layer count and heads)
ASSISTANTS = {
    "E2B": dict(hidden_size=256, layers=["sliding_attention"] * 3 + ["full_attention"], heads=4,
                intermediate_size=2048, ordered=True, assumed="intermediate_size 2048"),
    "31B": dict(hidden_size=1024, layers=["sliding_attention"] * 3 + ["full_attention"], heads=16,
                intermediate_size=4096, ordered=False,
                assumed="4 layers (3 sliding, 1 full), 16 heads, intermediate_size 4096"),
}  # fmt: skip


def assistant_config(target, shape):
    """The Gemma4AssistantConfig dict of a target's released config with `shape`."""
    text = {k: target["text_config"][k] for k in TARGET_KEYS if k in target["text_config"]}
    n = len(shape["layers"])
    text.update(model_type="gemma4_text", hidden_size=shape["hidden_size"],
                intermediate_size=shape["intermediate_size"], num_attention_heads=shape["heads"],
                num_hidden_layers=n, layer_types=shape["layers"], num_kv_shared_layers=n,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                enable_moe_block=False, tie_word_embeddings=True)  # fmt: skip
    return dict(model_type="gemma4_assistant", text_config=text,
                backbone_hidden_size=target["text_config"]["hidden_size"],
                use_ordered_embeddings=shape["ordered"], num_centroids=2048,
                centroid_intermediate_top_k=32, tie_word_embeddings=True)  # fmt: skip


def write_assistant(folder, config):
    """config.json + one sparse shard of the assistant's tensors (token_ordering int64)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    shapes = dict(sorted(param_shapes(AssistantConfig.from_hf(config)).items()))
    ints = {n: ("I64", 8) for n in shapes if n.endswith("token_ordering")}
    write_sparse_shard(folder / "model.safetensors", shapes, ints)
    return sum(ints.get(n, ("", 2))[1] * math.prod(s) for n, s in shapes.items())


def _shapes(model, entry):
    """{value name: dims} of `model` with its inputs bound at the entry's first
    specialization (ONNX shape inference, functions included)."""
    spec = entry["specializations"][0]["name"]
    bound = {t["name"]: t["shapes"][spec] for t in entry["inputs"]}
    for value in model.graph.input:
        for dim, size in zip(value.type.tensor_type.shape.dim, bound.get(value.name, []),
                             strict=False):  # fmt: skip
            dim.Clear()
            dim.dim_value = size
    inferred = shape_inference.infer_shapes(model)
    values = list(inferred.graph.value_info) + list(inferred.graph.input)
    return {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}


MOVES = ("Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze")  # a weight's view, not a read


def reads(folder, entry, drafter_prefix="assistant."):
    """(target bytes, drafter bytes) of checkpoint weight one call of the graph reads (see
    the module): each weight followed through its moves (`MOVES`) to the nodes that read it,
    a whole read per node or function call, the rows for a Gather of it."""
    model = onnx.load(folder / entry["file"], load_external_data=False)
    sizes = {}
    for t in model.graph.initializer:
        ext = {e.key: int(e.value) for e in t.external_data if e.key == "length"}
        if ext:  # a checkpoint weight (the graph's own constants are not)
            sizes[t.name] = ext["length"]
    readers = {}
    for node in model.graph.node:
        for i, x in enumerate(node.input):
            readers.setdefault(x, []).append((node, i))
    shapes = _shapes(model, entry)
    total = {"target": 0, "drafter": 0}
    for w, nbytes in sizes.items():
        todo, seen = [w], set()
        while todo:
            value = todo.pop()
            for node, i in readers.get(value, []):
                if node.op_type in MOVES and i == 0:
                    todo += [o for o in node.output if o not in seen]
                    seen.update(node.output)
                    continue
                read = nbytes
                if node.op_type == "Gather" and i == 0:
                    rows = math.prod(shapes[node.input[1]])
                    read = nbytes // (shapes.get(value) or [1])[0] * rows
                total["drafter" if w.startswith(drafter_prefix) else "target"] += read
    return total["target"], total["drafter"]


def measure(name, work, log):
    """One model: write both checkpoints, export, count → a result row (dict)."""
    k, per_round, source = ACCEPTANCE[name]
    target, assistant, out = work / f"{name}-target", work / f"{name}-assistant", work / name
    write_sparse_checkpoint(target, CONFIGS[name])
    write_assistant(assistant, assistant_config(CONFIGS[name], ASSISTANTS[name]))
    cmd = [sys.executable, "-m", "codegen", "export", "--model", str(target), "--out", str(out),
           "--assistant", str(assistant), "--num-speculative-tokens", str(k), "--decode-only",
           "--budgets", "", "--ctx-len", "8192", "--no-verify", "--no-hash"]  # fmt: skip
    rc, wall, rss = child(cmd, work / f"{name}.log")
    if rc:
        raise SystemExit(f"{name}: export failed, see {work / f'{name}.log'}")
    manifest = json.loads((out / "manifest.json").read_text())
    graphs = {g["kind"]: g for g in manifest["graphs"]}
    decode = sum(reads(out, graphs["decode"]))
    target_part, drafter_part = reads(out, graphs["speculate"])
    spec = target_part + drafter_part
    log(f"{name}: exported in {wall:.1f} s, peak RSS {rss / 1e9:.2f} GB")
    return dict(model=name, k=k, wall=wall, decode=decode, target=target_part,
                drafter=drafter_part, spec=spec, per_round=per_round, source=source,
                assumed=ASSISTANTS[name]["assumed"])  # fmt: skip


def table(rows):
    """The printed table: bytes per call, per round against K + 1 decode calls, tokens per GB."""
    head = ("model", "K", "export s", "decode call GB", "speculate call GB (target + drafter)",
            "K+1 decode calls GB", "round / (K+1) decodes", "tokens/round (published)",
            "tokens per GB: decode", "speculative", "ratio")  # fmt: skip
    body = []
    for r in rows:
        plain, spec = 1 / (r["decode"] / 1e9), r["per_round"] / (r["spec"] / 1e9)
        body.append((r["model"], str(r["k"]), f"{r['wall']:.1f}", f"{r['decode'] / 1e9:.3f}",
                     f"{r['spec'] / 1e9:.3f} ({r['target'] / 1e9:.3f} + "
                     f"{r['drafter'] / 1e9:.3f})", f"{(r['k'] + 1) * r['decode'] / 1e9:.3f}",
                     f"{r['spec'] / ((r['k'] + 1) * r['decode']):.3f}",
                     f"{r['per_round']:.2f} ({r['source']})", f"{plain:.3f}", f"{spec:.3f}",
                     f"{spec / plain:.2f}x"))  # fmt: skip
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in [head, *body]]
    lines += [f"{r['model']} assistant, assumed: {r['assumed']}" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="E2B,31B")
    parser.add_argument("--keep", type=Path, help="write the checkpoints and exports here")
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [measure(m, work, log) for m in args.models.split(",")]
    print(table(rows))
    return 0 if all(r["wall"] < GOAL_S for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
