"""`blocked`: `reference` computed block by block in one of QEfficient's blocking modes, in
Python-unrolled loops over static slices (no Loop op in an export), with the online-softmax
state (m, l, O) of `ref.online_softmax`: the loops over a `ref.blocking_plan.Plan`'s batch, head
and query blocks, each block's kernel (`ref.attention.tiles`) jitted once per trace, and the heads
split over a mesh's devices."""

import functools
import weakref

import jax
import jax.numpy as jnp

from ref.attention.dense import _check_cache_rows, _check_positions, _check_values, _rows_of
from ref.attention.tiles import _cut_query_block, _keys, _kv_sides, _query_block, _tile_masks
from ref.blocking import BlockingConfig
from ref.cache import fold as fold_cache
from ref.sharding import auto_axes


def _cat(parts, axis):
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


# The block functions jitted for the trace `blocked` is called in (`_jit`), dropped with it.
_TRACED = weakref.WeakKeyDictionary()


def _trace_of(*arrays):
    """The JAX trace `blocked`'s arguments belong to: None when none is a tracer (an eager call),
    False when one is but JAX keeps its trace elsewhere than the (internal) `_trace`."""
    tracers = [x for x in arrays if isinstance(x, jax.core.Tracer)]
    return getattr(tracers[0], "_trace", False) if tracers else None


def _jit(fn, trace, **static):
    """`fn` with `static` bound, jitted: one function object per (fn, static) for every call of
    `blocked` inside `trace` (`_trace_of`), so a model's layers reuse one block's trace; shared
    by eager calls (trace None: those never run inside an export's trace); a new one per call
    when the trace is unknown (False: slower, the same numbers).

    JAX caches traces per function object, and a trace must not outlive its context (x64,
    jax2onnx's patched jnp functions: a trace of `_bias` made before an export and reused inside
    it put 2 MB constants in every tile of an ONNX function), hence one cache per trace.
    """
    key = (fn, tuple(sorted(static.items())))
    if trace is None:
        return _eager_jit(*key)
    if trace is False:
        return jax.jit(functools.partial(fn, **static))
    cache = _TRACED.setdefault(trace, {})
    if key not in cache:
        cache[key] = jax.jit(functools.partial(fn, **static))
    return cache[key]


@functools.lru_cache(maxsize=256)
def _eager_jit(fn, static):
    """`_jit` for eager calls (x64 is part of JAX's own cache key)."""
    return jax.jit(functools.partial(fn, **dict(static)))


def _executed_heads(plan, together):
    """The head blocks `_blocked` runs: the plan's, or with `together` (prefill modes) its blocks
    as one over all their kv heads, n_rep chunk by n_rep chunk.

    `Plan.heads` of a prefill mode lists one kv head per block, and the kernel kit
    (`codegen.plan`, `codegen.vectors`) publishes that schedule; run that way an export repeats
    every tile once per kv head (a 31B sliding layer at 8 query × 16 KV blocks: 2,048 tiles).
    QEfficient's prefill kernels compute every kv head of a tile in one matmul (`[B, Hkv·split,
    rc·tc, D]` in `blocked_qkv_attention_forward_prefill_headpar_offline`), and so does this:
    exact, since heads never mix — a batched matmul gives each head the numbers it gives alone.
    """
    if not together or len(plan.heads) == 1:
        return plan.heads
    if len({r for _, _, r in plan.heads}) != 1:
        raise ValueError(f"head blocks {plan.heads} differ in their n_rep chunks")
    return ((plan.heads[0][0], plan.heads[-1][1], plan.heads[0][2]),)


def _blocked(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    q_group,
    kv_group,
    plan,
    *,
    heads_together,
    sliding_window,
    scale,
    softcap,
    cache_rows=None,
):
    """`blocked` for one resolved plan on local arrays (see `blocked` for shapes); with
    `heads_together` the plan's head blocks run as one (`_executed_heads`); with `cache_rows`
    (not folded) k, v hold F cache slots, read block by block (`_keys`).

    Three jitted functions do the work: `_keys` per head block (each KV block's keys
    transposed, shared by every query block), `_tile_masks` per query block (each tile's mask,
    shared by every head block), `_query_block` per query block of each head block and n_rep
    chunk. Jitted once per trace (`_jit`), a model's layers reuse one trace of each shape: a
    trace of `blocked` costs a few calls, not the ~30 operations of each of its tiles (which
    made every trace of a 31B prefill graph ~30 s, and an export traces it four times).
    """
    b, h, s, d = q.shape
    hkv = k.shape[1] // b if plan.batch_fold else k.shape[1]
    if cache_rows is not None and plan.batch_fold:
        raise ValueError("cache_rows with batch_fold: take the rows before folding")
    g = h // hkv
    q5 = q.reshape(b, hkv, g, s, d)
    if plan.batch_fold:
        q5 = q5.reshape(1, b * hkv, g, s, d)
    trace = _trace_of(q, k, v, q_pos, kv_pos, q_group, kv_group)
    block_static = dict(plan=plan, scale=scale, softcap=softcap)
    block = _jit(_query_block, trace, **block_static)

    @functools.cache
    def kv_sides(r):
        return _jit(_kv_sides, trace, rows=r, kv=plan.kv)(kv_pos, kv_group)

    @functools.cache
    def masks(rows, heads, queries):
        fold = (b, hkv, heads) if plan.batch_fold else None
        fn = _jit(_tile_masks, trace, window=sliding_window, fold=fold)
        r, (q0, q1) = None if fold else rows, queries
        q_rows = slice(*r) if r else slice(None)
        q_groups = None if q_group is None else q_group[q_rows, q0:q1]
        return fn(q_pos[q_rows, q0:q1], q_groups, kv_sides(r))

    out_b, prev = [], None
    for rows in plan.batch:
        out_h = []
        for kv0, kv1, reps in _executed_heads(plan, heads_together):
            where = dict(rows=rows, heads=(kv0, kv1), dtype=q.dtype)
            if len(reps) * len(plan.q) == 1:  # tiles read once: cut as they are read
                cut = _jit(_cut_query_block, trace, **where, **block_static)
                read = functools.partial(cut, k=k, v=v, cache_rows=cache_rows)
            else:  # made once, read by every query block and n_rep chunk
                tiles = _jit(_keys, trace, **where, kv=plan.kv)(k, v, cache_rows)
                read = functools.partial(block, tiles=tiles)
            out_r = []
            for r0, r1 in reps:
                out_q = []
                for queries in plan.q:
                    qb = q5[rows[0] : rows[1], kv0:kv1, r0:r1, queries[0] : queries[1]]
                    heads = (kv0, kv1) if plan.batch_fold else None
                    out, prev = read(qb, masks=masks(rows, heads, queries), prev=prev)
                    out_q.append(out)
                out_r.append(_cat(out_q, 3))
            out_h.append(_cat(out_r, 2))
        out_b.append(_cat(out_h, 1))
    return _cat(out_b, 0).reshape(b, h, s, d)


def blocked(
    q,
    k,
    v,
    q_pos,
    kv_pos,
    *,
    mode=None,
    sliding_window=None,
    q_group=None,
    kv_group=None,
    scale=1.0,
    softcap=None,
    config=None,
    mesh=None,
    cache_rows=None,
    **options,
):
    """`reference`, computed block by block in one of QEfficient's blocking modes.

    q: [B, H, S, D]; k, v: [B, Hkv, T, D] (folded here with batch_fold), or [1, B·Hkv, T, D]
    with batch_fold; q_pos, q_group: [B, S]; kv_pos, kv_group: [B, T] → [B, H, S, D].
    cache_rows: None, or [B] int (continuous batching, as in `reference`): k, v [F, Hkv, T, D]
    hold F cache slots and row b reads slot cache_rows[b], gathered one KV block at a time
    (with batch_fold or a mesh, all at once before folding or sharding). mode
    and options (num_kv_blocks, num_q_blocks, head_block_size, num_batch_blocks,
    headpar_split, batch_fold, prefill_block_chunks, prefill_n_rep_chunk, skip_kv, ctx_len,
    num_cores, ordered) as in `ref.blocking.BlockingConfig`, or a ready `config=`. mesh: a
    `jax.sharding.Mesh`; the heads are split over all its devices with shard_map (Hkv must
    divide evenly) and each device runs the same mode on its heads.
    """
    if config is None:
        if mode is None:
            raise ValueError("blocked() needs mode=... (or config=BlockingConfig(...))")
        config = BlockingConfig(mode=mode, **options)
    elif mode is not None or options:
        raise ValueError("give either config= or mode= with options, not both")
    q_pos, kv_pos = jnp.asarray(q_pos), jnp.asarray(kv_pos)
    groups = (q_group, kv_group)
    if (q_group is None) != (kv_group is None):
        raise ValueError("q_group and kv_group must be given together (vision run ids, -1 = text)")
    b, h, s, _ = q.shape
    fold = config.batch_fold
    if cache_rows is not None and (fold or mesh is not None):
        k, v = _rows_of(k, v, q, cache_rows)
        cache_rows = None
    if fold and k.shape[0] == b:  # as a model's layers hold it: folded here (a reshape)
        k, v = fold_cache(k), fold_cache(v)
    if fold and k.shape[0] != 1:
        raise ValueError(f"batch_fold expects a cache [1, B·Hkv, T, D] or [B, Hkv, T, D], "
                         f"got k {k.shape} for batch {b}")  # fmt: skip
    _check_values(q, k, v, q_pos, kv_pos)
    if cache_rows is not None:
        _check_cache_rows(q, cache_rows)
    k_batch = not fold and cache_rows is None
    _check_positions(q, k, q_pos, kv_pos, q_group, kv_group, k_batch=k_batch)
    hkv = k.shape[1] // b if fold else k.shape[1]
    if fold and k.shape[1] != b * hkv:
        raise ValueError(f"batch_fold cache rows {k.shape[1]} are not a multiple of batch {b}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"query heads {h} must be a multiple of kv heads {hkv}")
    kwargs = dict(sliding_window=sliding_window, scale=scale, softcap=softcap)
    kwargs["heads_together"] = "r" in config.axes
    if mesh is None:
        plan = config.plan(b, h, hkv, s, k.shape[2], num_devices=jax.local_device_count())
        return _blocked(q, k, v, q_pos, kv_pos, *groups, plan, cache_rows=cache_rows, **kwargs)
    return _sharded(q, k, v, q_pos, kv_pos, groups, config, mesh, kwargs)


def _sharded(q, k, v, q_pos, kv_pos, groups, config, mesh, kwargs):
    """`blocked` with the heads split over every device of `mesh` (shard_map; an explicit-axis
    mesh is used with Auto axes, `sharding.auto_axes`, so the arrays need no placement)."""
    from jax.sharding import PartitionSpec as P

    mesh = auto_axes(mesh)
    if config.batch_fold:
        raise ValueError("a mesh shards the heads of an unfolded cache; drop batch_fold")
    n = mesh.size
    b, h, s, _ = q.shape
    hkv = k.shape[1]
    if hkv % n:
        raise ValueError(f"kv heads {hkv} must split evenly over the mesh's {n} devices")
    plan = config.plan(b, h // n, hkv // n, s, k.shape[2], num_devices=n)
    heads = P(None, mesh.axis_names)
    arrays = [q, k, v, q_pos, kv_pos] + [x for x in groups if x is not None]
    specs = (heads, heads, heads) + (P(),) * (len(arrays) - 3)

    def local(q, k, v, q_pos, kv_pos, *grp):
        grp = grp if grp else (None, None)
        return _blocked(q, k, v, q_pos, kv_pos, *grp, plan, **kwargs)

    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=heads)
    return fn(*arrays)
