"""Running an export in onnxruntime: `Runner` (`runtime`), the `run` and `serve` commands'
inputs and output (`commands`), images and videos (`media`), the chat template (`chat`).
Imports `folder` only, so `run` and `serve` load without jax2onnx."""
