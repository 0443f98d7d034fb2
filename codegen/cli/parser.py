"""The command line's grammar: `parser()` for `python -m codegen` and its subcommands (export,
run, serve, verify, drift, vectors, plan), with the argument types that read their values."""

import argparse
from pathlib import Path

from codegen.cli import arguments
from codegen.export.options import EXPORT_DEFAULTS as D
from ref import formats
from ref.blocking import VISION_TILES
from ref.gemma4.images import BUDGETS, DEFAULT_BUDGETS


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (exit 2), without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser():
    p = _Parser(
        prog="python -m codegen",
        description="Gemma 4 for QAIC: export weight-free ONNX graphs, run and serve them in "
        "onnxruntime, verify them against ref; golden vectors and schedule plans for kernels.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    e = sub.add_parser("export", help="write weight-free ONNX graphs and QAIC artifacts")
    e.add_argument(
        "--model",
        type=Path,
        help="HF checkpoint folder (default: the embedded "
        "tiny Gemma 4, written once to $GEMMA4_QAIC_CACHE or ~/.cache/gemma4-qaic)",
    )
    e.add_argument(
        "--out",
        type=Path,
        default=Path("export"),
        help="output folder (default ./export); must be absent or empty unless --force",
    )
    e.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    e.add_argument(
        "--budgets",
        type=arguments.int_list,
        help="vision soft-token budgets, one specialization each, from "
        f"{','.join(map(str, BUDGETS))} (default {','.join(map(str, DEFAULT_BUDGETS))}; "
        "empty: no vision graph)",
    )
    e.add_argument(
        "--vision-tiles",
        type=arguments.tiles,
        metavar="QxKV",
        help="the vision graph's attention in Q query tiles × KV tiles with the online-softmax "
        "state, so one tile's scores are live at a time; each count must divide every "
        "budget's num_patches (9·budget; divisors of 630 do); 1x1 = the dense segment mask "
        f"(default {VISION_TILES[0]}x{VISION_TILES[1]})",
    )
    e.add_argument(
        "--graphs",
        type=arguments.graph_kinds,
        help="what to export besides the vision tower: model (the language model's prefill "
        "and decode graphs; the default), attention (stacks of text attention layers, one per "
        "--blocking mode, for kernel work), or model,attention",
    )
    e.add_argument(
        "--prefill-blocking",
        type=arguments.phase_blocking,
        metavar="MODE[:opt=v,...]",
        help="the prefill graph's attention: none (dense, the default), q, kv, qkv, online "
        "(QEfficient's prefill modes) or any mode of --blocking; options left out take the "
        "mode's defaults, e.g. qkv:num_kv_blocks=4",
    )
    e.add_argument(
        "--decode-blocking",
        type=arguments.phase_blocking,
        metavar="MODE[:opt=v,...]",
        help="the decode graph's attention: none (dense, the default) or a mode such as kv, "
        "hqkv, bhqkv, kv_headpar with its options (left out: the mode's defaults)",
    )
    e.add_argument(
        "--moe-prefill",
        type=arguments.moe_mode,
        metavar="MODE[:opt=v,...]",
        help="how the prefill graph runs a MoE checkpoint's experts: dense (every expert on "
        "every token), gather (each token's top-k experts' matrices) or nsp[:num_nsp=N,"
        "packed_chunk=C] (experts over N cores, routed tokens packed in C-row chunks; N "
        "defaults to --num-cores, C to 256 when it divides batch x seq_len, else all rows); "
        "default as QEfficient: nsp when --num-cores divides the experts, else dense",
    )
    e.add_argument(
        "--moe-decode",
        type=arguments.moe_mode,
        metavar="MODE[:opt=v,...]",
        help="how the decode graph runs a MoE checkpoint's experts (modes of --moe-prefill); "
        "default gather, as QEfficient",
    )
    e.add_argument(
        "--full-batch-size",
        type=int,
        help="continuous batching (QEfficient's): the KV cache holds N request slots, prefill "
        "and decode take batch_index, decode runs over all N slots",
    )
    for phase in ("prefill", "decode"):
        e.add_argument(
            f"--comp-ctx-lengths-{phase}",
            type=arguments.int_list,
            metavar="L1,L2,...",
            help=f"compute context lengths of the {phase} graph (QEfficient's CCL): it takes "
            "comp_ctx_lengths [L] (int64, only its length read) and attends to the first L "
            "cache slots, one specialization per L; ctx_len is appended when missing, and "
            "run/serve feed each step the least L above its positions",
        )
    e.add_argument(
        "--sliding-ring",
        action=argparse.BooleanOptionalAction,
        help="sliding-window layers keep a ring of min(sliding_window, ctx_len) slots, as "
        "QEfficient sizes them (the default); --no-sliding-ring: ctx_len slots, as full layers",
    )
    e.add_argument(
        "--blocking",
        type=arguments.blocking_modes,
        action="append",
        metavar="MODE[:opt=v,...]",
        help="with --graphs attention, an attention graph per use: a mode (kv, q, h, qkv, hq, "
        "hkv, hqkv, bhqkv, kv_headpar, kv_batch_fold, prefill_q, prefill_kv, prefill_qkv, "
        "prefill_online, none = dense) with QEfficient block options such as "
        "num_kv_blocks=4,head_block_size=2 (options left out: the mode's defaults); "
        "`all` = every mode (the default)",
    )
    e.add_argument(
        "--attention-layers",
        type=int,
        help="layers per attention graph (default: every leading text layer that owns its KV "
        "cache, one head layout per layer type)",
    )
    e.add_argument(
        "--batch-size", type=int, help=f"batch of every text graph (default {D['batch_size']})"
    )
    e.add_argument(
        "--seq-len",
        type=int,
        help=f"tokens per prefill chunk and attention call (default {D['seq_len']}; decode is "
        "1); a prompt's image runs must each fit in one chunk",
    )
    e.add_argument(
        "--ctx-len",
        type=int,
        help="KV cache length; with language graphs every vision budget must be < ctx_len "
        f"(default {D['ctx_len']})",
    )
    e.add_argument(
        "--weights",
        choices=("external", "inputs"),
        help="external: initializers pointing into the safetensors shards (default); "
        "inputs: graph inputs + weight spec v5 (QEfficient's form)",
    )
    e.add_argument(
        "--no-subfunctions",
        dest="sub_functions",
        action="store_false",
        help="inline repeated layers instead of ONNX functions",
    )
    e.add_argument(
        "--legacy-specializations",
        action="store_true",
        help="flat specializations.json for older SDKs",
    )
    e.add_argument(
        "--kv-dtype",
        help="retained KV cache precision in "
        f"custom_io.yaml: one of {', '.join(formats.with_aliases(formats.KV))}; default float16",
    )
    e.add_argument("--num-cores", type=int, help=f"-aic-num-cores (default {D['num_cores']})")
    e.add_argument("--mxfp6", action="store_true", help="add -mxfp6-matmul")
    e.add_argument("--mos", type=int, help="add -mos=N")
    e.add_argument("--mdp-config", help="add -mdp-load-partition-config=FILE")
    e.add_argument(
        "--num-devices",
        type=int,
        help="tensor-slice each graph over N devices: writes QEfficient's mdp_ts_N.json "
        f"(--num-cores per device) and passes it to qaic-compile (default {D['num_devices']})",
    )
    phase = e.add_mutually_exclusive_group()
    phase.add_argument(
        "--prefill-only",
        dest="phases",
        action="store_const",
        const=("prefill",),
        help="disaggregated serving: the vision and prefill graphs only (the manifest records "
        "the KV-cache layout the decode side must share)",
    )
    phase.add_argument(
        "--decode-only",
        dest="phases",
        action="store_const",
        const=("decode",),
        help="disaggregated serving: the decode graph only",
    )
    e.add_argument("--hw-version", help=f"-aic-hw-version (default {D['hw_version']})")
    e.add_argument(
        "--clip-fp16",
        action="store_true",
        help="clamp to the float16 range each weight that leaves it and the known overflow "
        "points (the vision standardize step), as QEfficient's FP16ClipTransform clips "
        "initializers; recorded per graph in manifest.json (default off)",
    )
    e.add_argument(
        "--no-hash",
        dest="hash_shards",
        action="store_false",
        help="skip the shards' sha256 in manifest.json",
    )
    e.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the onnxruntime check at the end",
    )
    r = sub.add_parser("run", help="generation over an export's vision, prefill and decode graphs")
    r.add_argument("out", type=Path, help="an export folder (written with --graphs model)")
    r.add_argument(
        "--prompt",
        metavar="TEXT",
        help="the prompt as text, one image placeholder (<|image|>) per --image and one "
        "<|video|> per --video; needs the checkpoint's tokenizer.json (copied into the export "
        "folder)",
    )
    r.add_argument(
        "--image",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="an image file (PNG, JPEG, ...), resized as Gemma 4's image processor does "
        "(repeatable, in the order of the prompt's placeholders)",
    )
    arguments.add_video_arguments(r)
    r.add_argument(
        "--max-soft-tokens",
        type=int,
        help="soft tokens per --image, one of the exported budgets (default: the largest "
        "exported budget that fits one prefill chunk)",
    )
    r.add_argument(
        "--prompt-ids",
        type=arguments.token_ids,
        action="append",
        metavar="ID,ID,...",
        help="one prompt row's token ids (repeatable: one row each, up to the exported batch "
        "size); with --patches each image already expanded to its run of image tokens, with "
        "--image one image token id per image",
    )
    r.add_argument(
        "--patches",
        type=Path,
        action="append",
        default=[],
        metavar="F.npy",
        help="an image's patches [h·w, 3·p·p] in [0, 1], row-major (repeatable: one per "
        "image run, in order of appearance, row by row)",
    )
    r.add_argument(
        "--grid",
        type=arguments.grid,
        action="append",
        default=[],
        metavar="HxW",
        help="that image's grid in patches (repeatable, paired with --patches in order)",
    )
    r.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        help="render --prompt with the checkpoint's chat template as one user turn followed by "
        "the model's (Gemma4Processor.apply_chat_template(add_generation_prompt=True)); the "
        "default when the export holds a template; --no-chat sends the text as it is",
    )
    r.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate at most (16)")
    arguments.add_generation_arguments(r)
    r.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (vision, chunks, steps)"
    )
    r.add_argument(
        "--decode-from",
        type=Path,
        metavar="DIR",
        help="disaggregated serving: OUT is a --prefill-only export whose KV cache is handed to "
        "the decode graph of DIR (a --decode-only export with the same cache layout)",
    )
    r.add_argument(
        "--skip-shard-check",
        action="store_true",
        help="do not check the shards' sizes, sha256 and byte ranges against manifest.json "
        "(a shard changed after export then goes unnoticed)",
    )
    sv = sub.add_parser(
        "serve", help="continuous batching of requests over an export with --full-batch-size"
    )
    sv.add_argument("out", type=Path, help="an export folder (written with --full-batch-size)")
    sv.add_argument(
        "--requests",
        type=Path,
        required=True,
        metavar="FILE.jsonl",
        help="one request a line: {prompt_ids, patches, grids} or {prompt|prompt_ids, images, "
        "videos, video_fps}, "
        "max_new_tokens (16), arrival (the step it joins at, 0), chat (as run's --chat), "
        "sample, temperature, top_k, top_p, seed (each request's own; the options below are "
        "the defaults)",
    )
    arguments.add_generation_arguments(sv)
    sv.add_argument(
        "--skip-shard-check",
        action="store_true",
        help="do not check the shards against manifest.json",
    )
    v = sub.add_parser("verify", help="onnxruntime vs ref on every graph and specialization")
    v.add_argument("out", type=Path, help="an export folder")
    v.add_argument("--seed", type=int, default=0, help="random input seed (default 0)")
    v.add_argument(
        "--skip-shard-check",
        action="store_true",
        help="do not check the shards' sizes, sha256 and byte ranges against manifest.json",
    )
    v.add_argument(
        "--graph",
        action="append",
        dest="graphs",
        metavar="NAME",
        help="check only this graph (repeatable; default every graph in manifest.json)",
    )
    v.add_argument(
        "--specialization",
        action="append",
        dest="specializations",
        metavar="NAME",
        help="check only this specialization, e.g. prefill_1120 (repeatable; default all; its "
        "random inputs are the same as when all are checked)",
    )
    how = v.add_mutually_exclusive_group()
    how.add_argument(
        "--layerwise",
        dest="layerwise",
        action="store_const",
        const=True,
        help="check the language graphs layer by layer (each layer's weights read when it is "
        "reached; memory set by the largest layer); default: when their float32 weights "
        "exceed 256 MiB",
    )
    how.add_argument(
        "--whole",
        dest="layerwise",
        action="store_const",
        const=False,
        help="check every graph whole (all its weights loaded at once)",
    )
    v.add_argument(
        "--precision",
        choices=formats.with_aliases(formats.LOW),
        help="instead: run ref and the graphs as the device computes them in this format "
        "(ref.numerics): per layer the largest |x| and headroom, the error to float32, exit 1 "
        "naming the first tensor that turns non-finite",
    )
    v.add_argument(
        "--kv-dtype",
        choices=formats.KV,
        help="with --precision: the KV cache's storage format (QAIC's --kv-dtype)",
    )
    v.add_argument(
        "--write-npi",
        action="store_true",
        help="with --precision: find the node outputs that must stay float32 for each graph "
        "to stay finite on the calibration inputs (the first to overflow kept, again until "
        "none does) and write GRAPH.npi.yaml (QAIC's node-precision-info), which compile.sh "
        "passes as -node-precision-info",
    )
    d = sub.add_parser("drift", help="greedy tokens: float32 ref vs the device's precision")
    d.add_argument("out", type=Path, nargs="?", help="an export folder (or --model)")
    d.add_argument("--model", type=Path, help="an HF checkpoint folder instead of an export")
    d.add_argument("--prompts", type=int, default=8, help="random prompts with an image (8)")
    d.add_argument("--max-new-tokens", type=int, default=8, help="tokens per prompt (8)")
    d.add_argument("--precision", choices=formats.with_aliases(formats.LOW), default="float16")
    d.add_argument("--kv-dtype", choices=formats.KV, default="float16")
    d.add_argument("--seed", type=int, default=0, help="random prompt seed (default 0)")
    d.add_argument(
        "--plans",
        action="store_true",
        help="instead: the export's graphs in onnxruntime, float32 against the device model of "
        "the same graphs under no node-precision plan, the measured one (GRAPH.npi.yaml from "
        "verify --precision --write-npi) and QEfficient's rule (all but MatMuls in float32), "
        "each with its count of float32 nodes",
    )
    d.add_argument(
        "--mxfp6",
        nargs="?",
        const="e2m3",
        choices=("e2m3", "e3m2"),
        help="the device side's matmul weights stored as MXFP6 (QAIC's -mxfp6-matmul; OCP MX "
        "v1.0, blocks of 32 along the reduction axis): element format e2m3 (the default) or "
        "e3m2, an assumption: Qualcomm does not publish it (docs/precision.md)",
    )
    _kit_parsers(sub)
    return p


def _kit_parsers(sub):
    """`vectors` and `plan`: the kernel author's kit (`codegen.kit`)."""
    from codegen.kit.vector_options import OP_MODES, OPS

    modes = "; ".join(f"{op}: {', '.join(m)} (default {m[0]})" for op, m in OP_MODES.items())

    def common(q, ops):
        q.add_argument("--op", choices=ops, default="attention", help="the op (attention)")
        q.add_argument(
            "--mode",
            metavar="MODE",
            help=f"{modes}; block counts left out take the mode's defaults in "
            "ref.blocking.TABLE (nsp: num_nsp=2, packed_chunk=4)",
        )
        q.add_argument(
            "--opt",
            action="append",
            default=[],
            metavar="K=V",
            help="an option of the op (repeatable): sizes, mask (q_start, sliding_window, "
            "vision, softcap, scale), any BlockingConfig field; moe: tokens, hidden, experts, "
            "intermediate, top_k, hot, num_nsp, packed_chunk; see docs/blocking.md",
        )
        for name in ("batch", "heads", "kv_heads", "seq", "ctx", "head_dim"):
            flag = "--" + name.replace("_", "-")
            q.add_argument(flag, dest=f"size_{name}", metavar="N", help=f"same as --opt {name}=N")

    vec = sub.add_parser("vectors", help="golden vectors of one op (safetensors + JSON)")
    common(vec, OPS)
    vec.add_argument("--out", type=Path, required=True, help="output folder (created)")
    vec.add_argument("--seed", type=int, default=0, help="random input seed (default 0)")
    vec.add_argument("--fp16", action="store_true", help="add float16 inputs and out_f16")
    vec.add_argument("--bf16", action="store_true", help="add bfloat16 inputs and out_bf16")
    pl = sub.add_parser("plan", help="one attention or MoE mode's schedule: costs and picture")
    common(pl, tuple(OP_MODES))
    pl.add_argument("--png", type=Path, help="draw the schedule to this PNG file")
    pl.add_argument(
        "--dtype",
        choices=formats.COMPUTE,
        default="float16",
        help="q/k/v/o precision for the byte counts (default float16)",
    )
