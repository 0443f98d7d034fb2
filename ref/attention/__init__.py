"""Masked softmax attention in the QAIC KV-cache layout: the dense reference and every blocked mode.

`attend` is the one dense kernel; `reference` is `attend` under the Gemma 4 `mask`
(`ref.attention.dense`); `blocked` (`ref.attention.blocks`) computes the same numbers block by
block with the online-softmax state (m, l, O) — row max, softmax denominator, unnormalized
output; `ref.online_softmax` — in Python-unrolled loops over static slices, so an export has no
Loop op and a compiler that runs the blocks in order holds one block's scores at a time
(`ordered=True` enforces that order on schedulers that do not, such as XLA:CPU).

Inside, queries are grouped by kv head: `q [B, H, S, D]` is viewed as `[B, Hkv, g, S, D]`
(kv head j serves query heads j·g … j·g+g−1), masks as `[B, 1 | Hkv, 1 | g, S, T]`.
"""

from ref.attention.blocks import blocked
from ref.attention.dense import attend, mask, reference

__all__ = ["attend", "blocked", "mask", "reference"]
