"""`vectors`' and `plan`'s arguments: the kernel author's kit (`codegen.kit`), one op and mode
each (`kit_parsers`)."""

from pathlib import Path

from ref import formats


def kit_parsers(sub):
    """The `vectors` and `plan` subcommands, their options in `--help` order."""
    from codegen.kit.vector_options import OP_MODES, OPS, PLAN_OPS

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
            "intermediate, top_k, hot, num_nsp, packed_chunk; audio_attention: clips, "
            "frame_budget, max_clips, heads, head_dim, chunk, context_left, context_right, cap; "
            "see docs/blocking.md",
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
    pl = sub.add_parser(
        "plan", help="one attention or MoE mode's schedule, or the audio chunks: costs, picture"
    )
    common(pl, PLAN_OPS)
    pl.add_argument("--png", type=Path, help="draw the schedule to this PNG file")
    pl.add_argument(
        "--dtype",
        choices=formats.COMPUTE,
        default="float16",
        help="q/k/v/o precision for the byte counts (default float16)",
    )
