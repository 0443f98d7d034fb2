"""Running an export in onnxruntime: `Runner` and its graph steps (`runtime`), the vision
graph's calls (`vision`), continuous batching's requests and slots (`slots`), the runner's
error (`errors`), the `run` and `serve` commands' inputs and output (`commands`), images and
videos (`media`), the chat template (`chat`). Imports `folder` only, so `run` and `serve` load
without jax2onnx."""
