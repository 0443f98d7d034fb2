"""What a layer-by-layer pass holds from layer to layer (`codegen.check.layerwise`,
`codegen.check.layered_precision`): the aligned buffers a layer's weights are read into
(`Buffers`), reused by the next layer, and each layer kind compiled once (`Compiled`)."""

import gc
import math
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from codegen.folder.sessions import give_back
from ref import numerics

# buffers in use from which `Buffers.reclaim` collects garbage (a fresh page costs about
# 0.5 ns a byte: 64 MiB of new buffers cost ~30 ms, a collection in a large process more)
RECLAIM_BYTES = 64 << 20
# the bytes a tensor stored in another type is read through (`Buffers.read`)
STAGE_BYTES = 64 << 20


def float32_bytes(spec, checkpoint):
    """Bytes of a graph's weights as float32 (what a whole-graph check holds twice)."""
    return sum(4 * math.prod(checkpoint.tensors[n].shape) for n in spec.weights)


class Buffers:
    """Aligned buffers reused from layer to layer by one pass over a graph's layers: a fresh
    page costs this machine's kernel about 0.5 ns a byte to hand out, so a 31B layer's
    weights (1 GB of bfloat16 read, 2 GB of float32) cost a second of system time a layer
    when each layer's arrays were new. A buffer is handed out again only when no array made
    from it is alive (its reference count: every view's base is the buffer), so an array
    `jax.device_put` shares (a jax array keeps it until collected) is never overwritten."""

    def __init__(self):
        self.owned, self.base = [], []

    def _refs(self, i):
        return sys.getrefcount(self.owned[i])

    def _free(self, size):
        """Indices of the buffers of at least `size` bytes that no array uses."""
        return [i for i in range(len(self.owned))
                if len(self.owned[i]) >= size and self._refs(i) <= self.base[i]]  # fmt: skip

    def reclaim(self):
        """Collect garbage when buffers of RECLAIM_BYTES or more are still in use: the jax
        arrays of a layer that has run let their buffers go only when collected (a reference
        cycle). Below that, new buffers cost less than a collection (a full one walks every
        object of the process: 0.1–0.3 s a layer in a test worker, for a tiny model's few
        kilobytes)."""
        free = set(self._free(0))
        used = sum(len(b) for i, b in enumerate(self.owned) if i not in free)
        if used >= RECLAIM_BYTES:
            gc.collect()

    def empty(self, shape, dtype, align=64):
        """An uninitialised C-contiguous array of `shape` and `dtype` (aligned as
        `graphs.aligned_empty`), in the smallest free buffer that holds it, else a new one."""
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + align
        free = self._free(size)
        if free:
            buf = self.owned[min(free, key=lambda i: len(self.owned[i]))]
        else:
            self.owned.append(np.empty(size, np.uint8))
            self.base.append(self._refs(len(self.owned) - 1))
            buf = self.owned[-1]
        start = -buf.ctypes.data % align
        return buf[start : start + size - align].view(dtype).reshape(shape)

    def read(self, checkpoint, name, dtype=np.float32):
        """Checkpoint tensor `name` as `dtype` in one of the buffers (stored in another type:
        read and cast STAGE_BYTES at a time through another one). A whole second buffer held
        the 26B-A4B's largest bfloat16 expert table (1 GB) for the pass's life."""
        info = checkpoint.tensors[name]
        out = self.empty(info.shape, dtype)
        if info.np_dtype == out.dtype:
            return checkpoint.read(name, out=out)
        return checkpoint.read(name, out=out, stage=self.empty((STAGE_BYTES,), np.uint8))


def collected(spec, checkpoint):
    """What a pass over a graph's layers left to the garbage collector freed and handed back
    (its weight buffers, held by jax arrays in reference cycles: 3 GB of a 31B layer's)
    before the next pass; nothing when its weights hold less than RECLAIM_BYTES as float32
    (less than the collection costs)."""
    if float32_bytes(spec, checkpoint) >= RECLAIM_BYTES:
        gc.collect()
        give_back()


def stored_weights(names, checkpoint, buffers, precision):
    """Checkpoint tensors `names` as float32 jax arrays already in `precision` (`numerics.
    round_to` of each, bit for bit: the same XLA conversions), each read in the type the
    checkpoint stores it in into `buffers` and widened and rounded by one compiled program,
    for `ref.probe_jit`'s `stored`: rounded inside a layer's program, a 31B decode layer's
    weights took 1.9 of its 2.6 GB of temporaries, on top of their 1.9 GB of float32."""
    buffers.reclaim()
    precision = numerics.format_name(precision)
    read = [buffers.read(checkpoint, n, checkpoint.tensors[n].np_dtype) for n in names]
    return [_widened(jax.device_put(w), precision) for w in read]


@partial(jax.jit, static_argnums=1)
def _widened(w, precision):
    return numerics.round_to(w.astype(jnp.float32), precision)


def signature(arrays):
    """The shapes and element types of `arrays` (jax or numpy arrays, `graphs.Drawn`, shape
    structs), hashable: what a layer's program or stand-ins are kept under."""
    return tuple((tuple(a.shape), str(np.dtype(a.dtype))) for a in arrays)


class Compiled:
    """Each layer kind's results (`graphs._Slot.results`) compiled once (`jax.jit`) for one
    pass over a graph's layers. Run op by op, `ref.layers.linear`'s `weight.T` was a
    transposed copy of every weight (2 GB of fresh pages a 31B layer); compiled through
    `ref.numerics.emulate` in float32 (the same values: nothing is rounded), each transpose
    is folded into the matmul that reads it, which XLA:CPU does not do at one row (a decode
    step). Layers of one kind share structure and static inputs
    (`graphs.route_layers` checks), so the first call's trace serves them all.

    A program whose temporaries (XLA's own memory plan) exceed TEMP_BYTES runs op by op
    instead, each temporary freed when its operation is done: XLA schedules independent work
    at once, so a 26B-A4B MoE layer's `nsp` prefill (8 expert slots × 4 token chunks, each
    slot's weights transposed) held 5–6 GB of temporaries compiled."""

    TEMP_BYTES = 2 << 30

    def __init__(self):
        self.fns = {}

    def results(self, kind, slot, arrays):
        """slot.results(arrays) → (distinct results, out_map, outputs' tree)."""
        if kind not in self.fns:
            found = {}

            def body(*a):
                distinct, found["map"], found["tree"] = slot.results(list(a))
                return distinct

            self.fns[kind] = (jax.jit(numerics.emulate(body, "float32")), found, {})
        fn, found, programs = self.fns[kind]
        key = signature(arrays)
        if key not in programs:
            program = fn.lower(*arrays).compile()
            temp = program.memory_analysis().temp_size_in_bytes
            programs[key] = program if temp <= self.TEMP_BYTES else None
        program = programs[key]
        if program is None:  # op by op
            made, out_map, tree = slot.results(list(arrays))
            return jax.block_until_ready(made), out_map, tree
        made = jax.block_until_ready(program(*arrays))  # its weights' buffers are then free
        return made, found["map"], found["tree"]
