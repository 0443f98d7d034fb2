"""Lowers `ref` through jax2onnx to weight-free ONNX graphs for QAIC (the only package that
knows ONNX or QAIC exists), checks and runs them. Entry points: `python -m codegen
export|verify|run|serve|drift|vectors|plan`, or `codegen.export.export(ExportOptions(...))`,
`codegen.verify.verify(folder)` and `codegen.runtime.Runner(folder)`. The export folder is
read through `codegen.folder` (manifest.json and its format, sessions), which the runner
imports without the exporter."""
