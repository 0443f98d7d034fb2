"""Pure JAX reference implementations: Gemma 4 vision tower, blocked attention, KV cache.

`ref` never reads files and never imports torch, onnx, `weights` or `codegen`.
"""
