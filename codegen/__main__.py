"""`python -m codegen export|run|serve|verify|drift|vectors|plan`: dispatch (the grammar is in
codegen/cli/parser.py; see `--help` of each)."""

import sys

from codegen.cli.arguments import blocking_modes
from codegen.cli.parser import parser


def _run_kit(args):
    """Run `vectors` or `plan`; a bad option is one line on stderr and exit code 2."""
    from codegen.kit import audio_schedule, draw, moe_schedule, schedule, vector_options, vectors

    sizes = [(k[5:], v) for k, v in vars(args).items() if k.startswith("size_") and v is not None]
    try:
        given = vector_options.parse_pairs(args.opt + [f"{k}={v}" for k, v in sizes])
        if args.command == "vectors":
            low = [p for p, on in (("float16", args.fp16), ("bfloat16", args.bf16)) if on]
            meta = vectors.write(args.out, args.op, args.mode, given, seed=args.seed, low=low)
            print(vectors.summary(meta))
            print(f"wrote {args.out / 'vectors.safetensors'} and {args.out / 'vectors.json'}")
            return 0
        mode, options = vector_options.resolve(args.op, args.mode, given)
        if args.op == "audio_attention":
            result = audio_schedule.report(options, args.dtype)
        else:
            kit = moe_schedule if args.op == "moe" else schedule
            result = kit.report(mode, options, args.dtype)
        print(result["table"])
        if args.png is not None:
            info = draw.draw(args.png, result, options)
            print(f"wrote {args.png} ({info['tiles']} of {info['tiles_total']} tiles drawn)")
    except ValueError as e:
        print(f"python -m codegen {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _run_verify(
    folder, seed, check_shards=True, layerwise=None, graphs=None, specs=None, calls=None
):  # fmt: skip
    """onnxruntime against ref on the folder's graphs: the table, exit code 1 on a mismatch."""
    from codegen.check.verify import table, verify

    if not check_shards:
        print(
            "verify: shards not checked against manifest.json (--skip-shard-check)", file=sys.stderr
        )
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    rows = verify(
        folder, seed=seed, check_shards=check_shards, layerwise_given=layerwise, log=log,
        graphs=graphs, specializations=specs, calls=calls,
    )  # fmt: skip
    print(table(rows))
    bad = [r for r in rows if not r[-1]]
    if bad:
        print(f"verify: {len(bad)} of {len(rows)} comparisons mismatch", file=sys.stderr)
        return 1
    return 0


def _run_precision(args):
    """`verify --precision`: the device-precision table (exit code 1 on a non-finite tensor),
    or with --write-npi the node-precision plans."""
    from codegen.check.precision import precision_table, verify_precision

    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.prompts is not None and not args.write_npi:
        raise ValueError("verify --prompts: calibrates a plan, give --write-npi too")
    if args.write_npi:
        from codegen.check.npi import plans_table, write_plans

        plans = write_plans(
            args.out, args.precision, kv_dtype=args.kv_dtype, seed=args.seed,
            check_shards=not args.skip_shard_check, graphs=args.graphs, log=log,
            mxfp6=args.mxfp6, prompts=args.prompts, layerwise_given=args.layerwise,
            specializations=args.specializations,
        )  # fmt: skip
        print(plans_table(plans, args.precision))
        return 0
    results = verify_precision(
        args.out, args.precision, kv_dtype=args.kv_dtype, seed=args.seed,
        check_shards=not args.skip_shard_check, layerwise_given=args.layerwise, log=log,
        graphs=args.graphs, specializations=args.specializations, mxfp6=args.mxfp6,
        npi=not args.no_npi, isolate=True,
    )  # fmt: skip
    text, bad = precision_table(results, args.precision, args.mxfp6)
    print(text)
    return 1 if bad else 0


def _run_drift(args):
    """`drift`: greedy tokens of float32 ref against the device precision, or with --plans the
    export's graphs under each node-precision plan."""
    from codegen.check.drift import drift, drift_table
    from ref.gemma4.model import Gemma4
    from ref.gemma4.unified_config import MODEL_TYPE
    from ref.gemma4.unified_model import Gemma4Unified
    from weights import open_checkpoint

    if (args.out is None) == (args.model is None):
        raise ValueError("drift: give an export folder or --model DIR (one of them)")
    unified = open_checkpoint(args.model or args.out).config.get("model_type") == MODEL_TYPE
    model = (Gemma4Unified if unified else Gemma4).from_pretrained(args.model or args.out)
    if model.vision is None:
        raise ValueError(
            f"{args.model or args.out}: drift needs a model with a vision tower (or embedder)"
        )
    if args.plans:
        from codegen.check.plan_drift import plan_drift, plan_drift_table

        if args.out is None:
            raise ValueError("drift --plans: give an export folder (the plans name its nodes)")
        rows = plan_drift(
            args.out, model, prompts=args.prompts, precision=args.precision,
            max_new_tokens=args.max_new_tokens, seed=args.seed,
        )  # fmt: skip
        print(plan_drift_table(rows, args.precision, args.prompts))
        return 0
    rows = drift(
        model, prompts=args.prompts, precision=args.precision, kv_dtype=args.kv_dtype,
        max_new_tokens=args.max_new_tokens, seed=args.seed, mxfp6=args.mxfp6,
    )  # fmt: skip
    print(drift_table(rows, args.precision, args.kv_dtype, args.mxfp6))
    return 0


def _run_check(args):
    """`verify`: with --precision the device-precision run, else onnxruntime against ref."""
    if args.calls == "one" and (args.layerwise is False or args.precision is not None):
        given = "--whole" if args.layerwise is False else f"--precision {args.precision}"
        raise ValueError(f"verify --by-function {given}: expected neither (by layer function "
                         "is float32, layer by layer)")  # fmt: skip
    if args.precision is not None:
        return _run_precision(args)
    options = (("--write-npi", args.write_npi), ("--mxfp6", args.mxfp6),
               ("--prompts", args.prompts), ("--no-npi", args.no_npi))  # fmt: skip
    given = [o for o, on in options if on]
    if given:
        raise ValueError(f"verify {' '.join(given)}: needs --precision (fp16, bf16, ...)")
    return _run_verify(
        args.out, args.seed, not args.skip_shard_check, args.layerwise, args.graphs,
        args.specializations, args.calls,
    )  # fmt: skip


def _run_generation(args):
    """`run` or `serve` (`codegen.run`, which reads the folder without the exporter)."""
    from codegen.run.commands import main as run_main
    from codegen.run.commands import serve_main

    return (serve_main if args.command == "serve" else run_main)(args)


def _run_export(args):
    """`export`: write the folder, print its summary, then verify it unless --no-verify."""
    # the exporter (jax2onnx) is imported only to export: run and serve read the folder
    from codegen.export.command import ExportOptions, export, summary

    blocking = tuple(x for group in (args.blocking or [blocking_modes("all")]) for x in group)
    # options left out are None here and take ExportOptions' defaults: their one home
    fields = {
        k: v for k, v in vars(args).items() if k not in ("command", "blocking") and v is not None
    }
    opts = ExportOptions(blocking=blocking, **fields)
    manifest, seconds = export(opts)
    print(summary(manifest))
    print(f"wrote {opts.out} in {seconds:.1f} s")
    if opts.verify:
        return _run_verify(opts.out, 0)
    return 0


_COMMANDS = {
    "export": _run_export,
    "run": _run_generation,
    "serve": _run_generation,
    "verify": _run_check,
    "drift": _run_drift,
    "vectors": _run_kit,
    "plan": _run_kit,
}


def main(argv=None):
    """Parse `argv` and run its command; a bad input (ValueError) is one line on stderr and exit
    code 2."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad option already reported in one line
        return e.code
    try:
        return _COMMANDS[args.command](args)
    except ValueError as e:  # CheckpointError, GraphError, ExportError, ...: bad input
        print(f"python -m codegen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
