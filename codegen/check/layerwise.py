"""`verify` layer by layer: a released-size graph checked in memory set by its largest layer.

The exported graph calls one ONNX function per decoder, vision or audio (conformer) layer. Its
top-level nodes are cut into segments (`codegen.check.segments`): each layer call alone (with the
Casts of its own weights), and the runs of glue between calls (embeddings, vision merge, masks,
rotary tables, the audio subsampling, final norm, logits, embed_audio). `ref` runs the graph's
composition eagerly with every layer's weights left out; when it reaches a layer, `check` reads
that layer's weights from the shards, runs the `ref` layer, and runs in onnxruntime first the
glue segments that come before the call, then the call alone on the same inputs `ref` gave its
layer (so an error stays in the layer that made it).
onnxruntime's values that `ref` also has are compared where both exist: glue results against the
`ref` layer's inputs, each call's results against the `ref` layer's results, the graph's other
outputs against `ref`'s at the end. Then the layer's weights and sessions are dropped, and
values no later segment reads are freed.

The dense attention of `ref` runs one slice of queries at a time (`sliced_reference`), so its
scores stay near `SCORE_BYTES` at any context length.
"""

import ctypes
import dataclasses
import mmap
import os
import re
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from codegen import graphs
from codegen.check.head_slices import head_rows
from codegen.check.layer_buffers import Buffers, Compiled
from codegen.check.segments import LayerwiseError, Runner
from codegen.folder.sessions import LIBC, give_back
from codegen.graphs import speculate
from ref.attention import reference
from ref.cache import take_rows
from ref.gemma4.step import Logits
from ref.layers import Embedding
from ref.numerics import aval, host_call

RTOL = 1e-5  # as verify.RTOL: the same tolerance per compared value
SCORE_BYTES = 1 << 28  # float32 scores of one query slice of the dense reference
ERROR_CHUNK = 1 << 24  # elements compared at a time (a 1 GiB cache: 64 chunks of 128 MiB)
SPILL_BYTES = 64 << 20  # a `ref` result above this waits on disk while it is not read (`spilled`)
PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # Linux
LAYER_NAME = re.compile(r"(^|\.)layers\.\d+\.")
_PLACEHOLDER = np.zeros((0,), np.float32)


def sliced_reference(q, k, v, q_pos, kv_pos, *, q_group=None, kv_group=None, cache_rows=None, **kw):
    """`ref.attention.reference` computed over slices of the queries, one after another
    (exact: each query attends independently). q: [B, H, S, D]; a slice keeps H·slice·T
    float32 scores under SCORE_BYTES. The slices are a `lax.map` over queries padded to a
    whole number of slices (the last query repeated, its copies cut off): a loop that XLA
    runs one slice at a time, also inside a jitted layer, where a Python loop's slices would
    be scheduled at once (the 12B's full prefill layer at 65,536 slots: 16 slices of 256 MiB
    of scores and their softmax alive together, 13.1 GB against 5.6 GB). With cache_rows
    (continuous batching: k, v hold F cache slots) one batch row at a time, its slot taken
    once: a gathered copy of one slot, never of every row (a 31B full layer with 4 slots of
    65,536: 1 GiB instead of 4)."""
    if cache_rows is not None:
        return _per_row(q, k, v, q_pos, kv_pos, q_group, kv_group, cache_rows, kw)
    b, h, s, _ = q.shape
    step = max(1, SCORE_BYTES // (4 * b * h * k.shape[2]))
    if step >= s:
        return reference(q, k, v, q_pos, kv_pos, q_group=q_group, kv_group=kv_group, **kw)
    n = -(-s // step)

    def sliced(x, axis):
        """x padded along `axis` to n·step (edge values), the slices moved to a new axis 0."""
        x = jnp.pad(x, [(0, n * step - s if a == axis else 0) for a in range(x.ndim)], "edge")
        x = x.reshape(*x.shape[:axis], n, step, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    def one(part):
        qs, ps, gs = part
        grp = {} if q_group is None else dict(q_group=gs, kv_group=kv_group)
        return reference(qs, k, v, ps, kv_pos, **grp, **kw)

    groups = sliced(q_pos, 1) if q_group is None else sliced(q_group, 1)
    out = jax.lax.map(one, (sliced(q, 2), sliced(q_pos, 1), groups))  # [n, B, H, step, Dv]
    out = jnp.moveaxis(out, 0, 2)
    return out.reshape(b, h, n * step, out.shape[-1])[:, :, :s]


def _per_row(q, k, v, q_pos, kv_pos, q_group, kv_group, cache_rows, kw):
    """`sliced_reference` of each batch row b on its own cache slot cache_rows[b] → [B, H, S, D]."""
    parts = []
    for b in range(q.shape[0]):
        one = slice(b, b + 1)
        grp = {} if q_group is None else dict(q_group=q_group[one], kv_group=kv_group[one])
        rows = take_rows((k, v), cache_rows[one])
        parts.append(sliced_reference(q[one], *rows, q_pos[one], kv_pos[one], **grp, **kw))
    return jnp.concatenate(parts, axis=0)


def error(got, want, chunk=ERROR_CHUNK):
    """(max abs error, relative error) of onnxruntime's `got` against `ref`'s `want`, in
    float64 over `chunk` elements at a time (a NaN anywhere gives NaN)."""
    mapped = [x for x in (got, want) if isinstance(x, np.memmap)]
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf"), float("inf")
    if not want.size:
        return 0.0, 0.0
    got, want = got.reshape(-1), want.reshape(-1)
    err = scale = np.float64(0.0)
    for a in range(0, want.size, chunk):
        w = want[a : a + chunk].astype(np.float64)
        err = np.maximum(err, np.max(np.abs(got[a : a + chunk].astype(np.float64) - w)))
        scale = np.maximum(scale, np.max(np.abs(w)))
        for x in mapped:
            drop_pages(x.reshape(-1)[a : a + chunk])
    err, scale = float(err), float(scale)
    return err, err / scale if scale else err


def drop_pages(x):
    """Hand back the whole pages under x, a view of a read-only file mapping (`spilled`), with
    madvise(MADV_DONTNEED): they are read again from the file if touched, so a compared result
    does not stay resident (a 31B full layer's written caches with 4 slots: 4 GiB). Nothing
    without glibc."""
    if LIBC is None or not x.size:
        return
    start = -(-x.ctypes.data // PAGE) * PAGE
    end = (x.ctypes.data + x.nbytes) // PAGE * PAGE
    if end > start:
        LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


def passes(err, rel, exact):
    """The verdict on one compared output: exact (token ids, positions) when `exact`, else
    within RTOL of the reference's scale."""
    return err == 0 if exact else rel <= RTOL


class Worst:
    """The largest relative error per compared output, and where it was."""

    def __init__(self):
        self.rows = {}

    def add(self, output, got, want, where, exact=False):
        err, rel = error(got, want)
        ok = passes(err, rel, exact)
        old = self.rows.get(output)
        if old is None or (not ok and old[3]) or (ok == old[3] and rel > old[1]):
            self.rows[output] = (err, rel, where, ok)


def _checkpoint_name(names, module, keys):
    """The checkpoint name of parameter `keys` of the bound `module`: the one name of the
    graph's weights ending in the module's path and the keys."""
    suffix = ".".join([*module.path, *keys])
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    if len(found) != 1:
        raise LayerwiseError(f"parameter {suffix!r}: {len(found)} checkpoint names end in it")
    return found[0]


def kind_weights(names, kind):
    """The weights a layer of function `kind` takes its parameters from: a speculate graph's
    drafter layers (`Assistant…`) the drafter's (`assistant.*`), every other layer the rest
    (both models have `model.layers.0…`)."""
    own = kind.startswith(speculate.DRAFTER)
    return [n for n in names if n.startswith(speculate.PREFIX) == own]


def layer_names(names, module):
    """The checkpoint names of the bound layer's parameters, in leaf order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(module.variables["params"])
    return [_checkpoint_name(names, module, [k.key for k in path]) for path, _ in flat]


def layer_arrays(names, checkpoint, module, buffers=None):
    """The bound layer's parameters read from the shards as float32 numpy arrays, in leaf
    order, each aligned (so `jax.device_put` shares it: one copy serves `ref` and
    onnxruntime; `np.asarray` of a jax array would copy), in `buffers` (a `Buffers`) when
    given, else new ones."""
    buffers = buffers or Buffers()
    buffers.reclaim()
    return [buffers.read(checkpoint, n) for n in layer_names(names, module)]


def layer_weights(names, checkpoint, module, buffers=None):
    """The bound layer's parameters read from the shards as float32 jax arrays (`layer_arrays`)."""
    return [jax.device_put(a) for a in layer_arrays(names, checkpoint, module, buffers)]


def gather_rows(names, checkpoint):
    """An interceptor computing `ref.layers.Embedding` from the shard's rows when its table
    was left out (`weight[ids] · scale`, only the rows asked for are read; traced ids: the
    read is a `host_call`)."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if not isinstance(module, Embedding) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if module.variables["params"]["weight"].size:
            return next_fun(*args, **kwargs)
        table = checkpoint.read(_checkpoint_name(names, module, ["weight"]))

        def rows(ids):
            return [jnp.asarray(np.asarray(table[np.asarray(ids)], np.float32))]

        ids = args[0]
        if isinstance(ids, jax.core.Tracer):
            (got,) = host_call(rows, [aval((*ids.shape, table.shape[1]))], ids)
        else:
            (got,) = rows(ids)
        return got * jnp.asarray(module.scale, jnp.float32)

    return interceptor


def head_slices(name, checkpoint):
    """An interceptor computing `ref.gemma4.step.Logits` with its weight left out: the module
    itself on VOCAB_ROWS rows of the checkpoint's `name` at a time, joined along the vocab."""

    def interceptor(next_fun, args, kwargs, context):
        mine = isinstance(context.module, Logits) and context.method_name == "__call__"
        if not mine or args[1].size:
            return next_fun(*args, **kwargs)
        # each slice computed before the next is read: dispatched ahead, all eight slices of
        # the 31B's head (5.6 GB as float32, and their transposes) were held at once
        parts = [jax.block_until_ready(next_fun(args[0], jnp.asarray(rows)))
                 for rows in head_rows(checkpoint, name)]  # fmt: skip
        return jnp.concatenate(parts, axis=-1)

    return interceptor


def deferred_weights(spec, checkpoint):
    """verify's {name: float32 weight}, with every layer's weights, the row-gathered tables
    and the output head left out (an empty placeholder): they are read when `ref` reaches
    them."""
    deferred = {n for n in spec.weights if LAYER_NAME.search(n)} | set(spec.gathered)
    deferred |= {spec.head} - {None}
    return {
        n: _PLACEHOLDER
        if n in deferred
        else np.asarray(checkpoint.read(n, mapped=False), np.float32)
        for n in spec.weights
    }


def _kernel(spec):
    """The language graphs' reference attends by query slices (`sliced_reference`); the
    vision reference attends per item in tiles already."""
    text = ("prefill", "decode", "language", "speculate")
    return {"attention": sliced_reference} if spec.kind in text else {}


def aligned(x, align=64, dtype=None):
    """x (as `dtype`, default its own) in a buffer aligned to `align` bytes, which
    `jax.device_put` on CPU uses in place instead of copying (numpy's large arrays start 16
    bytes into a page; `jnp.asarray` always copies): the sample's caches, read by both sides,
    are then held once. A conversion writes straight into the aligned buffer."""
    x = np.asarray(x)
    dtype = x.dtype if dtype is None else np.dtype(dtype)
    if x.dtype == dtype and x.flags.c_contiguous and x.ctypes.data % align == 0:
        return x
    out = graphs.aligned_empty(x.shape, dtype, align)
    out[...] = x
    return out


def spilled(x, folder, at=None):
    """x, or when over `at` bytes (SPILL_BYTES when None) a read-only numpy copy mapped from a
    file in `folder` that is unlinked at once (the mapping keeps its bytes): the page cache
    holds it, and may drop it, not the process, until it is read. For `ref`'s large results
    while onnxruntime runs the same layer (a 31B full layer's written caches: 1 GiB)."""
    if x.nbytes <= (SPILL_BYTES if at is None else at):
        return x
    fd, path = tempfile.mkstemp(prefix=".spill.", suffix=".npy", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.asarray(x))
        return np.load(path, mmap_mode="r")
    finally:
        os.remove(path)


def layered_reference(spec, checkpoint, feed, hook):
    """`spec.reference` on `feed` ({name: aligned array}, shared with `ref`, not copied) with
    the deferred weights (`deferred_weights`) and each layer call handed to
    hook(module, kind, slot, arrays) (`graphs.layer_check`); tables gathered by rows, the
    head by vocabulary slices, attention by query slices."""
    shared = {
        n: x if n in spec.lazy else jax.device_put(aligned(graphs.drawn(x)))
        for n, x in feed.items()
    }
    with (
        graphs.layer_scope(),
        graphs.layer_check(hook),
        # the tables gathered are the target's (a drafter's head is read whole)
        nn.intercept_methods(gather_rows(kind_weights(spec.weights, ""), checkpoint)),
        nn.intercept_methods(head_slices(spec.head, checkpoint)),
    ):
        return spec.reference(shared, deferred_weights(spec, checkpoint), **_kernel(spec))


def verify_specialization(spec, model, folder, checkpoint, feed, log, chosen=None, stand_ins=None):
    """Rows (output, max abs err, rel err, where, ok) of the graph `model` (`spec`'s export)
    on the inputs `feed`, checked layer by layer; log(line) reports each layer. chosen:
    {function name: the one call of it checked} (`by_function`), every other call given
    `stand_ins` (a `by_function.StandIns`, shared by a graph's specializations) on both
    sides, and the chosen call too where `stand_ins` checked it on inputs of the same shapes
    at an earlier specialization; None: every call checked."""
    for name in list(feed):
        x = feed.pop(name)
        feed[name] = x if isinstance(x, graphs.Drawn) else aligned(x)
    runner = Runner(model, folder, feed, (spec.head, *spec.other_heads), checkpoint)
    worst = Worst()
    names = spec.weights
    calls, buffers, compiled = [], Buffers(), Compiled()
    started = time.perf_counter()

    def agree(where, arrays, glue):
        """Compare the call's inputs onnxruntime's glue made (`glue`) with `ref`'s."""
        for j, (a, g) in enumerate(zip(arrays, glue, strict=True)):
            if g is not None and not isinstance(a, graphs.Drawn):
                worst.add("layer inputs", g, a, f"{where} input {j}", exact=a.dtype.kind != "f")

    def stand_in(k, module, kind, slot, arrays):
        mine = layer_names(kind_weights(names, kind), module)
        arrays, made, out_map, tree = stand_ins.results(k, kind, slot, arrays, mine)
        named = runner.segments[runner.calls[k]].nodes[-1].output
        # drawn into memory, and over SPILL_BYTES onto disk as a checked call's results are,
        # for glue that reads them later (a stand-in cache held to the end is 1 GiB a layer)
        made = [m if isinstance(m, graphs.Released) else spilled(graphs.drawn(m), folder)
                for m in runner.released(k, named, made)]  # fmt: skip
        glue = runner.skip(k, len(arrays), made)
        agree(f"layer {k} ({kind})", arrays, glue)
        calls.append(k)
        slot = dataclasses.replace(slot, out_map=out_map, out_tree=tree)
        return slot.outputs(arrays, made)

    def check(module, kind, slot, arrays):
        k = len(calls)
        if chosen is not None and chosen.get(kind) != k:
            return stand_in(k, module, kind, slot, arrays)
        if chosen is not None and stand_ins.checked_before(kind, arrays):
            log(f"  {spec.name}: layer {k} ({kind}) stood in: checked on inputs of these shapes")
            return stand_in(k, module, kind, slot, arrays)
        given = [graphs.drawn(a) for a in arrays]  # a `Drawn` cache: drawn for this layer
        arrays = [jax.device_put(g) if isinstance(a, graphs.Drawn) else a
                  for a, g in zip(arrays, given, strict=True)]  # fmt: skip
        mine = kind_weights(names, kind)
        host = layer_arrays(mine, checkpoint, module, buffers)
        params = [jax.device_put(a) for a in host]
        made, out_map, tree = compiled.results(kind, slot, [*arrays, *params])
        if any(src == "in" and j >= len(arrays) for src, j in out_map):
            raise LayerwiseError(f"layer {k} ({kind}) returns one of its weights")
        slot = dataclasses.replace(slot, out_map=out_map, out_tree=tree)
        where = f"layer {k} ({kind})"
        weights = list(zip(layer_names(mine, module), host, strict=True))
        del params, host
        made = [spilled(m, folder) for m in made]  # on disk while onnxruntime runs the layer
        glue, ours = runner.layer(k, kind, given, weights, made)
        del weights, given
        agree(where, arrays, glue)
        named = runner.segments[runner.calls[k]].nodes[-1].output
        for n, o, r in zip(named, ours, made, strict=True):
            output = n if n in runner.outputs else "layer outputs"
            worst.add(output, o, r, where)
        calls.append(k)
        del ours, glue
        give_back()
        log(f"  {spec.name}: {where} checked, {time.perf_counter() - started:.1f} s")
        return slot.outputs(list(arrays), runner.released(k, named, made))

    want = layered_reference(spec, checkpoint, feed, check)
    runner.glue_until(None)
    for t in spec.outputs:
        if t.name in runner.made and t.name not in worst.rows:
            exact = np.asarray(want[t.name]).dtype.kind != "f"
            worst.add(t.name, runner.made[t.name], want[t.name], "glue", exact=exact)
    order = [t.name for t in spec.outputs] + ["layer inputs", "layer outputs"]
    return [(o, *worst.rows[o]) for o in order if o in worst.rows]
