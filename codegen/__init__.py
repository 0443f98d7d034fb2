"""Lowers `ref` through jax2onnx to weight-free ONNX graphs for QAIC (the only package that
knows ONNX or QAIC exists), checks and runs them, in packages by job: `graphs` (what is
exported), `lower` (jax2onnx and its fixes), `folder` (the export folder's contract), `export`
(the command), `check` (verify, precision, drift), `run` (`run`, `serve`), `kit` (golden
vectors and schedules), `cli` (the command line); docs/map.md draws them. Entry points:
`python -m codegen export|verify|run|serve|drift|vectors|plan`, or
`codegen.export.command.export(ExportOptions(...))`, `codegen.check.verify.verify(folder)` and
`codegen.run.runtime.Runner(folder)`."""
