"""`verify`'s and `drift`'s arguments (`verify_parser`, `drift_parser`), with the device
precision options both take."""

from pathlib import Path

from ref import formats


def verify_parser(sub):
    """The `verify` subcommand, its options in `--help` order."""
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
        "random inputs are the same as when all are checked; with --write-npi the plan is "
        "calibrated on its inputs alone)",
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
    calls = v.add_mutually_exclusive_group()
    calls.add_argument(
        "--exhaustive",
        dest="calls",
        action="store_const",
        const="every",
        help="check every layer call numerically (layer by layer at released size), not one "
        "call per layer function (the default there)",
    )
    calls.add_argument(
        "--by-function",
        dest="calls",
        action="store_const",
        const="one",
        help="check the layer graphs by layer function at any size (the default where a graph "
        "is checked layer by layer): the glue and one call of each function "
        "(chosen by --seed, named in the log) against ref with that layer's weights, and a "
        "proof from the graph and the checkpoint's headers that every call binds its own "
        "layer's weights and inputs as ref does (the row 'bindings')",
    )
    _precision_arguments(
        v,
        precision_help="instead: run ref and the graphs as the device computes them in this "
        "format (ref.numerics): per layer the largest |x| and headroom, the error to float32, "
        "exit 1 naming the first tensor that turns non-finite",
        kv_help="with --precision: the KV cache's storage format (QAIC's --kv-dtype)",
    )
    v.add_argument(
        "--write-npi",
        action="store_true",
        help="with --precision: find the node outputs that must stay float32 for each graph "
        "to stay finite on the calibration inputs (the first to overflow kept, again until "
        "none does) and write GRAPH.npi.yaml (QAIC's node-precision-info), which compile.sh "
        "passes as -node-precision-info",
    )
    v.add_argument(
        "--no-npi",
        action="store_true",
        help="with --precision: ignore the folder's node-precision plans (GRAPH.npi.yaml; "
        "by default their nodes stay float32 in both device models, as compile.sh passes them)",
    )
    v.add_argument(
        "--prompts",
        type=Path,
        metavar="FILE",
        help="with --write-npi: calibrate on these requests instead of verify's drawn inputs "
        "(serve's JSONL: prompt, images, videos, max_new_tokens): every graph call made "
        "generating them with the float32 graphs",
    )
    _mxfp6_argument(
        v,
        "with --precision: the device side's matmul weights stored as MXFP6 (QAIC's "
        "-mxfp6-matmul; OCP MX v1.0, blocks of 32 along the reduction axis) in ref and in the "
        "graph, the float32 reference's as the checkpoint holds them: element format e2m3 (the "
        "default) or e3m2, an assumption (docs/precision.md)",
    )


def drift_parser(sub):
    """The `drift` subcommand, its options in `--help` order."""
    d = sub.add_parser("drift", help="greedy tokens: float32 ref vs the device's precision")
    d.add_argument("out", type=Path, nargs="?", help="an export folder (or --model)")
    d.add_argument("--model", type=Path, help="an HF checkpoint folder instead of an export")
    d.add_argument("--prompts", type=int, default=8, help="random prompts with an image (8)")
    d.add_argument("--max-new-tokens", type=int, default=8, help="tokens per prompt (8)")
    _precision_arguments(d, default="float16")
    d.add_argument("--seed", type=int, default=0, help="random prompt seed (default 0)")
    d.add_argument(
        "--plans",
        action="store_true",
        help="instead: the export's graphs in onnxruntime, float32 against the device model of "
        "the same graphs under no node-precision plan, the measured one (GRAPH.npi.yaml from "
        "verify --precision --write-npi) and QEfficient's rule (all but MatMuls in float32), "
        "each with its count of float32 nodes",
    )
    _mxfp6_argument(
        d,
        "the device side's matmul weights stored as MXFP6 (QAIC's -mxfp6-matmul; OCP MX "
        "v1.0, blocks of 32 along the reduction axis): element format e2m3 (the default) or "
        "e3m2, an assumption: Qualcomm does not publish it (docs/precision.md)",
    )


def _mxfp6_argument(parser, text):
    """--mxfp6 [e2m3|e3m2]: an MXFP6 element format, e2m3 when the option is given bare."""
    parser.add_argument("--mxfp6", nargs="?", const="e2m3", choices=("e2m3", "e3m2"), help=text)


def _precision_arguments(parser, default=None, precision_help=None, kv_help=None):
    """--precision (a low format of `ref.formats`, or an alias) and --kv-dtype (a KV cache
    format), both defaulting to `default`."""
    parser.add_argument(
        "--precision",
        choices=formats.with_aliases(formats.LOW),
        default=default,
        help=precision_help,
    )
    parser.add_argument("--kv-dtype", choices=formats.KV, default=default, help=kv_help)
