"""The command line's grammar: `parser()` for `python -m codegen` and its subcommands, each
command's arguments in its own module (export_args: export; run_args: run, serve; check_args:
verify, drift; kit_args: vectors, plan)."""

import argparse

from codegen.cli.check_args import drift_parser, verify_parser
from codegen.cli.export_args import export_parser
from codegen.cli.kit_args import kit_parsers
from codegen.cli.run_args import run_parser, serve_parser


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad option in one line (exit 2), without the usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser():
    """`python -m codegen`'s parser: export, run, serve, verify, drift, vectors, plan."""
    p = _Parser(
        prog="python -m codegen",
        description="Gemma 4 for QAIC: export weight-free ONNX graphs, run and serve them in "
        "onnxruntime, verify them against ref; golden vectors and schedule plans for kernels.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    export_parser(sub)
    run_parser(sub)
    serve_parser(sub)
    verify_parser(sub)
    drift_parser(sub)
    kit_parsers(sub)
    return p
