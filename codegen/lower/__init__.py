"""jax2onnx and its fixes: tracing a graph spec (`trace`), the QAIC op allow-list (`ops`),
`--clip-fp16` (`clip`). Imports `graphs` only."""
