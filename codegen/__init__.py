"""Lowers `ref` through jax2onnx to weight-free ONNX graphs for QAIC (the only package that
knows ONNX or QAIC exists). Entry points: `python -m codegen export|verify`, or
`codegen.export.export(ExportOptions(...))` and `codegen.verify.verify(folder)`."""
