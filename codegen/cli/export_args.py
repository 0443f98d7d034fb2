"""`export`'s arguments: what to export and where, the graphs' attention, MoE and cache layout,
their sizes, and how the artifacts are written and compiled (`export_parser`)."""

import argparse
from pathlib import Path

from codegen.cli import arguments
from codegen.export.options import EXPORT_DEFAULTS as D
from ref import formats
from ref.blocking import VISION_TILES
from ref.gemma4.images import BUDGETS, DEFAULT_BUDGETS


def export_parser(sub):
    """The `export` subcommand, its options in `--help` order."""
    e = sub.add_parser("export", help="write weight-free ONNX graphs and QAIC artifacts")
    _source_and_vision(e)
    _layout(e)
    _sizes(e)
    _artifacts(e)


def _source_and_vision(e):
    """--model, --out, --force; the vision graph's --budgets and --vision-tiles."""
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
        "--assistant",
        type=Path,
        metavar="DIR",
        help="an MTP assistant checkpoint (google/gemma-4-*-it-assistant): adds the speculate "
        "graph (verify K drafts, accept, draft the next K, in one call); its shards are "
        "hard-linked into OUT/assistant/; every language graph's sliding ring grows to "
        "window + K + 1 slots (with --prefill-only: the ring alone, for a decode side "
        "exported with the same assistant)",
    )
    e.add_argument(
        "--num-speculative-tokens",
        type=int,
        metavar="K",
        help="drafts per round with --assistant (default: the assistant's generation_config "
        "num_assistant_tokens, else 4)",
    )
    e.add_argument(
        "--budgets",
        type=arguments.int_list,
        help="vision soft-token budgets, one specialization each, from "
        f"{','.join(map(str, BUDGETS))} (default {','.join(map(str, DEFAULT_BUDGETS))}; "
        "empty: no vision graph)",
    )
    e.add_argument(
        "--audio-budgets",
        type=arguments.int_list,
        help="audio soft-token budgets (40 ms and 4 log-mel frames each, at most 750 = 30 s), "
        "one specialization of the audio graph each; exported only for a checkpoint with an "
        "audio tower (default "
        f"{','.join(map(str, D['audio_budgets']))}; empty: no audio graph)",
    )
    e.add_argument(
        "--audio-clips",
        type=int,
        help=f"the most clips one audio call packs (default {D['audio_clips']})",
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


def _layout(e):
    """Which graphs and how they compute: --graphs, the phases' attention blocking and MoE
    modes, continuous batching, compute context lengths, the sliding ring and the attention
    graphs' --blocking and --attention-layers."""
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


def _sizes(e):
    """The text graphs' --batch-size, --seq-len and --ctx-len."""
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


def _artifacts(e):
    """How the graphs are written (weights, functions, specializations, KV precision), the
    qaic-compile flags, the disaggregated phases, fp16 clipping, shard hashes and the final
    onnxruntime check."""
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
    e.add_argument(
        "--split-programs",
        action="store_true",
        help="the language model as two programs, prefill and decode, whose KV cache crosses "
        "the host between them; by default it is one program (prefill and decode "
        "specializations of one graph) wherever the phases' modes allow (docs/device.md)",
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
