"""Hugging Face checkpoints (config.json + safetensors, sharded or not), read lazily.

Headers are indexed first and validated as untrusted input; tensors are memory-mapped
one at a time; parameter trees keep the checkpoint's own names, split on ".".
"""

from weights.blocks import LazyTensor, read_block
from weights.checkpoint import (
    Checkpoint,
    check_shapes,
    generation_config,
    load_checkpoint,
    open_checkpoint,
    plan_shards,
    save_checkpoint,
)
from weights.errors import CheckpointError
from weights.safetensors import (
    DTYPES,
    TensorInfo,
    dtype_code,
    numpy_dtype,
    read_header,
    read_metadata,
    read_tensor,
)
from weights.writer import write_safetensors

__all__ = [
    "DTYPES",
    "Checkpoint",
    "CheckpointError",
    "check_shapes",
    "TensorInfo",
    "dtype_code",
    "generation_config",
    "LazyTensor",
    "load_checkpoint",
    "numpy_dtype",
    "open_checkpoint",
    "plan_shards",
    "read_block",
    "read_header",
    "read_metadata",
    "read_tensor",
    "save_checkpoint",
    "write_safetensors",
]
