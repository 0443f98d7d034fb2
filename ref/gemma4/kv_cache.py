"""The Gemma 4 decoder's KV cache: its layout per layer and how a step writes and reads it.

`init_cache` lays the cache out (slot = position, or a ring of W slots for sliding layers;
positions and vision-run ids recorded, or slots only as QAIC's retained state holds them);
`linear_memory` and `ring_memory` give a step the keys' positions and run ids and the write
policy its attention layers use. The array operations themselves are `ref.cache`'s.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.tree_util import Partial

from ref.cache import (
    causal_positions,
    fold,
    rolling_slots,
    scatter_positions,
    take_rows,
    unfold,
    update,
    window_keys,
)
from ref.gemma4.text_config import SLIDING


def init_cache(
    config, batch, ctx_len, dtype=jnp.float32, *, ring=False, slots_only=False, drafts=0
):
    """An empty KV cache of `ctx_len` slots (slot = position) for every layer that owns one.

    ring: sliding-window layers keep only a ring of R = `ring_slots(sliding_window, ctx_len,
    drafts)` slots (W, or W + drafts + 1; position p in slot p mod R), as a deployment would;
    drafts: the draft tokens a speculative round verifies (`ref.gemma4.speculative`), whose
    rejected keys must not evict a key a later step or the drafter reads. slots_only: keys
    and values only, as QAIC's retained state holds them; which position a slot holds is
    derived from each step's position_ids instead of recorded (see `linear_memory`), and no
    vision run continues from one step into the next (a prefill chunk must not split an image
    run).
    → {"k": {layer: [B, Hkv, T or W, hd]}, "v": likewise (layer keys are str(i)), and unless
    slots_only "pos": [B, T] int32 (−1 = empty), "group": [B, T] int32 (vision-run id, −1 =
    text), with ring also "ring_pos", "ring_group": [B, R]}.
    """
    c = config
    window = ring_slots(c.sliding_window, ctx_len, drafts)

    def shape(i):
        slots = window if ring and c.layer_types[i] == SLIDING else ctx_len
        return (batch, c.kv_heads[i], slots, c.head_dims[i])

    owners = [i for i in range(c.num_hidden_layers) if not c.shares_kv(i)]
    cache = {
        "k": {str(i): jnp.zeros(shape(i), dtype) for i in owners},
        "v": {str(i): jnp.zeros(shape(i), dtype) for i in owners},
    }
    if slots_only:
        return cache
    cache["pos"] = jnp.full((batch, ctx_len), -1, jnp.int32)
    cache["group"] = jnp.full((batch, ctx_len), -1, jnp.int32)
    if ring:
        cache["ring_pos"] = jnp.full((batch, window), -1, jnp.int32)
        cache["ring_group"] = jnp.full((batch, window), -1, jnp.int32)
    return cache


def ring_slots(window, ctx_len, drafts=0):
    """Slots of a sliding layer's ring: W, or W + drafts + 1 under speculation; at most ctx_len.
    A speculative round writes drafts + 1 keys from the position of its last token and may
    keep one; the rejected keys, up to P + drafts − 1 for the next round's first position P,
    evict the positions up to P + drafts − 1 − R. The next round's first query reads back to
    P + 1 − W, its drafter (`ref.gemma4.assistant`: distance ≤ W) to P − 1 − W: R ≥ W +
    drafts + 1 keeps both (`tests/ref/test_speculative.py`)."""
    if not isinstance(drafts, int) or drafts < 0:
        raise ValueError(f"drafts={drafts!r}: expected an int >= 0")
    return min(window + drafts + 1 if drafts else window, ctx_len)


def ring_len(config, cache):
    """The ring's slot count R of a cache whose sliding layers keep a ring (`uses_ring`)."""
    return min(k.shape[2] for i, k in cache["k"].items() if config.layer_types[int(i)] == SLIDING)


def cache_len(cache):
    """ctx_len of a cache: the longest layer cache (a ring holds fewer slots)."""
    return max(k.shape[2] for k in cache["k"].values())


def uses_ring(config, cache):
    """True when the cache keeps sliding layers in a ring (fewer slots than ctx_len)."""
    if "ring_pos" in cache:
        return True
    t = cache_len(cache)
    return any(
        config.layer_types[int(i)] == SLIDING and k.shape[2] < t for i, k in cache["k"].items()
    )


def _last_before(positions):
    """[B, 1]: the position before each row's first valid one (−1 for a row with none)."""
    valid = positions >= 0
    first = jnp.min(jnp.where(valid, positions, jnp.iinfo(jnp.int32).max), axis=1, keepdims=True)
    return jnp.where(jnp.any(valid, axis=1, keepdims=True), first - 1, -1)


def unfolded(kv, kv_heads):
    """(kv as [F, Hkv, T, hd], F) for a batch-folded layer cache kv ([1, F·Hkv, T, hd], row
    f·Hkv + h: QEfficient's kv_batch_fold layout), (kv, None) for one held unfolded."""
    if kv[0].shape[1] == kv_heads:
        return kv, None
    rows = kv[0].shape[1] // kv_heads
    return tuple(unfold(x, rows) for x in kv), rows


def cache_view(config, cache):
    """The cache's shapes with every layer's keys and values unfolded (`unfolded`), for checks
    that read its rows: {"k", "v": {layer: ShapeDtypeStruct [F, Hkv, T, hd]}, the rest as
    given}."""

    def shape(x, heads):
        one, rows, *rest = x.shape
        return tuple(x.shape) if rows == heads else (one * rows // heads, heads, *rest)

    def view(kv):
        return {
            i: jax.ShapeDtypeStruct(shape(x, config.kv_heads[int(i)]), x.dtype)
            for i, x in kv.items()
        }

    return dict(cache, k=view(cache["k"]), v=view(cache["v"]))


def _folded_write(write, kv, k, v):
    """write(kv, k, v) on kv unfolded (`unfolded`; k [B, Hkv, S, hd]), the stored cache handed
    back in the layout kv came in (a reshape each way, inside the layer)."""
    kv, rows = unfolded(kv, k.shape[1])
    stored, attended = write(kv, k, v)
    return (stored if rows is None else tuple(fold(x) for x in stored)), attended


def first_slots(x, key_len, axis):
    """x cut to its first `key_len` slots along `axis` (None: x whole); key_len may be an
    exporter's symbol (a compute context length). Always a new array, even at key_len = T
    (`lax.slice_in_dim`, where numpy-style slicing hands x back): a step's written cache and
    its attended keys are then two results at every length, as in the graph traced with a
    symbolic length (verify's layer-by-layer check pairs them by count)."""
    return x if key_len is None else lax.slice_in_dim(x, 0, key_len, axis=axis)


def _linear_write(positions, rows, key_len, kv, k, v):
    def write(kv, k, v):
        stored = update(*kv, k, v, positions, rows)
        return stored, tuple(first_slots(x, key_len, 2) for x in stored)

    return _folded_write(write, kv, k, v)


def linear_memory(cache, positions, groups, rows=None, key_len=None):
    """Slot = position: (cache with the step's positions and run ids recorded, the keys'
    {"kv_pos", "kv_group"} [B, T] (and "cache_rows" with rows), write(kv, k, v) → (stored,
    attended) for `Attention`).

    key_len: None, or a compute context length K ≤ T (an int or an exporter's symbol; every
    position of the step < K): the cache is written whole, but the step attends to its first K
    slots only (keys [B, K], attended [.., K, hd]), as QEfficient's `comp_ctx_lengths` reads.

    positions, groups: [B, S]; k, v: [B, Hkv, S, hd] written into kv [B, Hkv, T, hd] (or
    batch-folded [1, B·Hkv, T, hd], stored so again: `unfolded`). rows: None, or [B] int
    (continuous batching): kv holds F ≥ B cache slots, row b of the step is written straight
    into kv's row rows[b] (−1: nothing) and attends to that row: attended is the whole
    written cache [F, Hkv, T, hd] and the keys carry "cache_rows" = rows, which the attention
    reads a KV block at a time (`ref.attention.blocked`), never as a gathered copy. A
    slots-only cache derives the keys' positions (slot t holds position t up to the row's
    largest position) and knows only this step's run ids: every earlier key sits before all of
    this step's queries, so it is visible causally whatever its run.
    """
    if "pos" in cache:
        pos = scatter_positions(cache["pos"], positions, positions)
        group = scatter_positions(cache["group"], groups, positions)
        cache = dict(cache, pos=pos, group=group)
    else:
        pos = causal_positions(positions, cache_len(cache))
        # jnp.full, not full_like: an export keeps it as an op, not a [B, T] constant
        group = scatter_positions(jnp.full(pos.shape, -1, pos.dtype), groups, positions)
    keys = {"kv_pos": first_slots(pos, key_len, 1), "kv_group": first_slots(group, key_len, 1)}
    if rows is not None:
        keys["cache_rows"] = rows
    return cache, keys, Partial(_linear_write, positions, rows, key_len)


def _ring_write(ring_pos, positions, slots, rows, kv, k, v):
    def write(kv, k, v):
        seen = kv if rows is None else take_rows(kv, rows)
        k_all, v_all, _ = window_keys(*seen, ring_pos, k, v, positions)
        return update(*kv, k, v, slots, rows), (k_all, v_all)

    return _folded_write(write, kv, k, v)


def ring_positions(positions, window):
    """The positions a slots-only ring holds before a step at positions [B, S]: slot s holds the
    latest position ≤ the row's last one written that is ≡ s (mod W) → [B, W] (−1 = empty)."""
    last = _last_before(positions)
    slots = lax.broadcasted_iota(jnp.int32, (1, window), 1)
    held = last - jnp.mod(last - slots, window)
    return jnp.where(held >= 0, held, -1).astype(jnp.int32)


def ring_memory(cache, positions, groups, window, rows=None):
    """Sliding layers in a ring of `window` = R slots (`ring_slots`): like `linear_memory`
    (rows too), but a step attends to the ring as it was plus its own keys ([B, Hkv, R + S,
    hd], keys {"kv_pos", "kv_group"} [B, R + S]; the mask's sliding window picks the last W)
    and then the ring keeps each row's last R positions.
    """
    if "ring_pos" in cache:
        ring_pos, ring_group = cache["ring_pos"], cache["ring_group"]
        # a recorded position at or after the step's first is a rejected draft's (a
        # speculative round's, `ref.gemma4.speculative`): not read, this step writes it anew
        held = jnp.where(ring_pos > _last_before(positions), -1, ring_pos)
    else:
        held = ring_pos = ring_positions(positions, window)
        ring_group = jnp.full(ring_pos.shape, -1, ring_pos.dtype)
    slots = rolling_slots(positions, window)
    seen = {
        "kv_pos": jnp.concatenate([held, positions.astype(ring_pos.dtype)], axis=1),
        "kv_group": jnp.concatenate([ring_group, groups.astype(ring_group.dtype)], axis=1),
    }
    if "ring_pos" in cache:
        cache = dict(
            cache,
            ring_pos=scatter_positions(ring_pos, positions, slots),
            ring_group=scatter_positions(ring_group, groups, slots),
        )
    return cache, seen, Partial(_ring_write, held, positions, slots, rows)
