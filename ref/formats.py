"""The names of the device's float formats and of the KV cache's storage formats, in one place
and without JAX (the command line offers them; `ref.numerics` computes in them)."""

COMPUTE = ("float32", "float16", "bfloat16")  # what a graph computes in
LOW = ("float16", "bfloat16")  # the device formats `verify --precision` and `drift` model
KV = (*COMPUTE, "mxint8")  # what the retained KV cache is stored as (QAIC's --kv-dtype)
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def with_aliases(names):
    """names followed by the aliases of those among them (for a command line's choices)."""
    return (*names, *(a for a, name in ALIASES.items() if name in names))
