"""`Plan`: the static block boundaries one blocked-attention call unrolls its loops over, and the
arithmetic that cuts an axis into blocks (`ranges`, `head_blocks`). No JAX, no options: which
blocks a mode and a shape get, and the checks of its options against the shape, are
`ref.blocking.BlockingConfig.plan`'s.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static block boundaries: every range is a half-open `(start, end)` of Python ints.

    heads: per block `(kv_start, kv_end, ((r_start, r_end), ...))` — kv heads
    `[kv_start, kv_end)` with the query heads `j·g + r` of each, `r` in the listed ranges.
    split: KV pieces per block computed independently and merged once at the end (1 with
    `parallel` False means the sequential online recurrence). batch_fold: the cache is
    `[1, B·Hkv, T, D]` and the batch is folded into the heads. ordered: each block waits for
    the previous one.
    """

    batch: tuple
    heads: tuple
    q: tuple
    kv: tuple
    split: int
    parallel: bool
    skip_kv: bool
    batch_fold: bool
    ordered: bool = False


def ranges(n, blocks, length=None):
    """Blocks of `ceil(length / blocks)` over `[0, length)` clipped to `[0, n)`; the last takes
    the remainder and a block that would start at or past `n` is dropped. A symbolic n (an
    exporter's compute context length, which `blocks` divides: its constraint) gives `blocks`
    exact blocks of n // blocks, bounds without comparisons (a symbol's are inconclusive)."""
    if not isinstance(n, int):
        if length is not None and length is not n:
            raise ValueError(f"a symbolic length {n} is blocked over itself, not {length}")
        return tuple((i * (n // blocks), (i + 1) * (n // blocks)) for i in range(blocks))
    length = n if length is None else length
    size = -(-length // blocks)
    return tuple((i * size, min((i + 1) * size, n)) for i in range(blocks) if i * size < n)


def head_blocks(heads, kv_heads, size):
    """`Plan.heads` for blocks of `size` query heads (a multiple or a divisor of the GQA group
    size heads // kv_heads): whole groups per block, or each kv head's group cut into pieces."""
    group = heads // kv_heads
    if size % group == 0:
        return tuple((a // group, b // group, ((0, group),)) for a, b in _sized(heads, size))
    within = _sized(group, size)
    return tuple((j, j + 1, within) for j in range(kv_heads))


def _sized(n, size):
    """Consecutive `(start, end)` blocks of `size` over `[0, n)`, the last one shorter."""
    return tuple((i, min(i + size, n)) for i in range(0, n, size))
