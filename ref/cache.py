"""The QAIC KV cache as pure functions: writes, reads, the sliding-window ring, batch folding.

A cache is `[B, Hkv, T, D]`; the call's new keys or values are `[B, Hkv, S, D]`. Slots and
positions are int arrays with −1 meaning "nothing": a slot −1 writes nothing, a position −1 is
an empty slot. The cache a call returns is the next call's cache input (QAIC's retained state),
so chunked prefill is `update` then attention, chunk after chunk.

Writes are one ScatterND into the cache itself, every index in range (ScatterND neither clamps
nor drops): a write to −1 goes where it changes nothing (see `_write`). No copy of the cache is
made beside the one the scatter writes (a spare slot concatenated and sliced away cost one more
whole cache per write in onnxruntime, and a whole-cache copy per call on the device).
"""

import jax
import jax.numpy as jnp
from jax import lax


def scatter(cache, new, slots, rows=None):
    """Write `new` at `slots`: cache [B, Hkv, T, D], new [B, Hkv, S, D], slots [B, S] int.

    A slot −1 (or ≥ T) writes nothing; the slots of one row must otherwise be distinct.
    rows: None, or [B] int (continuous batching): cache is then [F, Hkv, T, D] and new's row b
    goes to cache row rows[b] (−1 or ≥ F: nothing), one scatter into the whole cache — the
    step's rows are not taken out and put back. Returns cache's shape, in cache's dtype.
    """
    b, hkv, t, d = cache.shape
    want = "slots [B, S]" if rows is None else "slots [B, S] and rows [B]"
    if rows is not None:
        b = rows.shape[0] if rows.ndim == 1 else None
    if new.shape[:2] != (b, hkv) or new.shape[3] != d or slots.shape != (b, new.shape[2]):
        got = "" if rows is None else f", rows {rows.shape}"
        raise ValueError(
            f"scatter expects new [B={b}, Hkv={hkv}, S, D={d}] and {want}; "
            f"got new {new.shape}, slots {slots.shape}{got}"
        )
    if rows is None:
        return _write(cache, 2, slots[:, None, :], new)
    return _write_rows(cache, rows, slots, new)


def scatter_positions(cache_pos, positions, slots):
    """Record which position each slot holds: cache_pos [B, T], positions and slots [B, S] int.

    A slot −1 writes nothing. Returns [B, T] int (−1 = empty slot).
    """
    return _write(cache_pos, 1, slots, positions)


def _write(array, axis, slots, values):
    """`array` [*L, T, *R] (L = its dims before `axis`) with `values` [*L, S, *R] written at
    `slots` (int, broadcastable to [*L, S]; one outside [0, T) writes nothing) → array's shape
    and dtype.

    One ScatterND into `array`, every index in range: an invalid write is sent where it changes
    nothing — onto its row's first valid write, with that write's value (a repeated index with
    an equal value gives the same result in any order), or, in a row with no valid write, onto
    slot 0 with slot 0's own value. Valid slots of one row must be distinct.
    """
    lead, t = array.shape[:axis], array.shape[axis]
    slots = jnp.broadcast_to(slots, lead + (values.shape[axis],))
    valid = (slots >= 0) & (slots < t)
    first = jnp.argmax(valid.astype(jnp.int32), axis=-1, keepdims=True)  # [*L, 1]
    some = jnp.any(valid, axis=-1, keepdims=True)  # [*L, 1]
    slots = jnp.where(
        valid,
        slots,
        jnp.where(some, jnp.take_along_axis(slots, first, -1, mode="promise_in_bounds"), 0),
    )

    def spread(x):  # [*L, S] → [*L, S, 1 …] against values
        return x.reshape(x.shape + (1,) * (array.ndim - axis - 1))

    values = values.astype(array.dtype)
    kept = jnp.where(
        spread(some),
        jnp.take_along_axis(values, spread(first), axis, mode="promise_in_bounds"),
        lax.slice_in_dim(array, 0, 1, axis=axis),
    )
    values = jnp.where(spread(valid), values, kept)
    # Shapes may be symbolic at export (batch, seq_len): iota instead of arange.
    index = tuple(
        lax.broadcasted_iota(
            jnp.int32, tuple(n if k == i else 1 for k, n in enumerate(lead)) + (1,), i
        )
        for i in range(axis)
    )
    return jnp.asarray(array).at[index + (slots,)].set(values, mode="promise_in_bounds")


def _first(valid):
    """(row, column), each [1, 1], of the first True of valid [B, S] in row-major order."""
    some = jnp.any(valid, axis=1, keepdims=True)  # [B, 1]
    row = jnp.argmax(some.astype(jnp.int32), axis=0, keepdims=True)
    at = jnp.argmax(valid.astype(jnp.int32), axis=1, keepdims=True)  # [B, 1]
    return row, jnp.take_along_axis(at, row, 0, mode="promise_in_bounds")


def _pick(x, row, col, axes=(0, 1)):
    """x at index `row` along axes[0] and `col` along axes[1] (both kept, size 1)."""
    grow = (1,) * (x.ndim - 2)
    for i, axis in zip((row, col), axes, strict=True):
        x = jnp.take_along_axis(x, i.reshape(i.shape + grow), axis, mode="promise_in_bounds")
    return x


def _write_rows(array, rows, slots, values):
    """`array` [F, H, T, D] with `values` [B, H, S, D] written at rows [B] and slots [B, S]
    (a row outside [0, F) or a slot outside [0, T) writes nothing) → array's shape and dtype.

    One ScatterND into `array`, every index in range: an invalid write is sent onto the first
    valid write (row-major over [B, S]) with that write's value, or, when nothing is valid,
    onto row 0, slot 0 with its own value. Valid (row, slot) pairs must be distinct.
    """
    f, t = array.shape[0], array.shape[2]
    rows = jnp.broadcast_to(rows[:, None], slots.shape)
    valid = (rows >= 0) & (rows < f) & (slots >= 0) & (slots < t)
    some = jnp.any(valid)
    b, s = _first(valid)
    values = values.astype(array.dtype)
    own = lax.slice_in_dim(lax.slice_in_dim(array, 0, 1, axis=0), 0, 1, axis=2)
    kept = jnp.where(some, _pick(values, b, s, axes=(0, 2)), own)  # [1, H, 1, D]
    rows = jnp.where(valid, rows, jnp.where(some, _pick(rows, b, s), 0))
    slots = jnp.where(valid, slots, jnp.where(some, _pick(slots, b, s), 0))
    values = jnp.where(valid[:, None, :, None], values, kept)
    heads = lax.broadcasted_iota(jnp.int32, (1, array.shape[1], 1), 1)
    index = (rows[:, None, :], heads, slots[:, None, :])
    return jnp.asarray(array).at[index].set(values, mode="promise_in_bounds")


def update(cache_k, cache_v, k_new, v_new, slots, rows=None):
    """The retained-state handoff: caches [B, Hkv, T, D] after writing k_new, v_new
    [B, Hkv, S, D] at slots [B, S] (−1 = nothing) — the next call's cache inputs (rows: see
    `scatter`)."""
    return scatter(cache_k, k_new, slots, rows), scatter(cache_v, v_new, slots, rows)


def span(x, start, end, axis):
    """x[start:end] along `axis`. Bounds may be an exporter's symbols (a compute context
    length's blocks): then `lax.slice_in_dim`, which jax2onnx lowers with symbolic bounds where
    numpy-style slicing does not trace; int bounds slice as numpy does."""
    if isinstance(start, int) and isinstance(end, int):
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, end)
        return x[tuple(index)]
    return lax.slice_in_dim(x, start, end, axis=axis)


def causal_positions(q_pos, cache_len):
    """Positions of a linear cache (slot t holds position t) as seen by a call whose queries sit
    at q_pos [B, S]: slot t is filled iff t ≤ the row's largest position → [B, T] (−1 = empty)."""
    last = jnp.max(q_pos, axis=1, keepdims=True)
    slots = lax.broadcasted_iota(q_pos.dtype, (1, cache_len), 1)
    return jnp.where(slots <= last, slots, -1)


def rolling_slots(positions, window):
    """Ring-buffer slots for a sliding-window layer: position p lives in slot p mod W.

    positions [B, S] int (−1 = padding) → slots [B, S] (−1 = write nothing). A position that a
    later one in the same call evicts (p ≤ row max − W) is not written, so the slots written by
    one call are distinct. Attention for the call itself must see the keys before eviction:
    attend over `concat(ring, new)` (see `window_keys`), then write the ring.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    last = jnp.max(positions, axis=1, keepdims=True)
    keep = (positions >= 0) & (positions > last - window)
    return jnp.where(keep, positions % window, -1)


def window_keys(ring_k, ring_v, ring_pos, k_new, v_new, new_pos):
    """Keys a sliding-window call attends to: the ring [B, Hkv, W, D] (positions [B, W]) and the
    call's own keys [B, Hkv, S, D] (positions [B, S]) → k, v [B, Hkv, W + S, D], kv_pos
    [B, W + S]. The mask's window keeps only the last W positions for each query."""
    k = jnp.concatenate([ring_k, k_new.astype(ring_k.dtype)], axis=2)
    v = jnp.concatenate([ring_v, v_new.astype(ring_v.dtype)], axis=2)
    return k, v, jnp.concatenate([ring_pos, new_pos.astype(ring_pos.dtype)], axis=1)


def fold(cache):
    """Batch fold: [B, Hkv, T, D] → [1, B·Hkv, T, D], batch b's kv head h at row b·Hkv + h."""
    b, hkv, t, d = cache.shape
    return cache.reshape(1, b * hkv, t, d)


def unfold(cache, batch):
    """Inverse of `fold`: [1, B·Hkv, T, D] → [B, Hkv, T, D]."""
    one, rows, t, d = cache.shape
    if one != 1 or rows % batch:
        raise ValueError(f"unfold expects [1, B·Hkv, T, D] with B={batch}; got {cache.shape}")
    return cache.reshape(batch, rows // batch, t, d)


def take_rows(tree, rows):
    """Continuous batching's read: every array of `tree` ([F, ...], one row per cache slot)
    at the step's slots rows [B] int → [B, ...]. A row outside [0, F) (−1 = no slot) reads
    the nearest slot (0 or F − 1); its result is not kept (`put_rows` drops its write)."""

    def take(a):
        return jnp.take(a, jnp.clip(rows, 0, a.shape[0] - 1), axis=0)

    return jax.tree_util.tree_map(take, tree)


def put_rows(tree, new, rows):
    """Continuous batching's write: `new` ([B, ...] per array) back into `tree`'s slots rows
    [B] int; a row −1 (or ≥ F) writes nothing; valid rows must be distinct → like `tree`."""

    def put(a, b):
        return _write(a, 0, rows, b)

    return jax.tree_util.tree_map(put, tree, new)
