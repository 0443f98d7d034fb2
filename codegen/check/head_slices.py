"""The output head and the gathered tables a slice at a time, for the layer-by-layer checks
(`segments`, `layerwise`, `layered_precision` of `codegen.check`): a glue segment that projects
onto the head runs VOCAB_ROWS of its rows at a time (`vocab_slices`), reading each slice from the
shard alone (`head_rows`), as `ref`'s device model does (`device_head`); a Gather of a cast
table casts only the gathered rows (`rows_before_cast`)."""

import jax.numpy as jnp
import numpy as np
from onnx import helper

from ref.gemma4.step import Logits
from ref.numerics import aval, host_call
from ref.probe_jit import probe_jit
from weights import read_block

VOCAB_ROWS = 1 << 15  # rows of the output head read at a time (262144 × 5376: 8 slices)


def rows_before_cast(nodes, weights):
    """`nodes` with each Gather of a cast weight (`Gather(Cast(W), i)`) computed as
    `Cast(Gather(W, i))`: the same values (a cast acts per element), without converting the
    whole table to float32 first (E2B's per-layer embeddings: 9.4 GB). A Cast of a weight
    that nothing else reads is dropped. The export keeps its own order."""
    cast_of = {
        n.output[0]: n.input[0]
        for n in nodes
        if n.op_type == "Cast" and n.input[0] in weights and n.domain in ("", "ai.onnx")
    }
    out, kept = [], set()
    for n in nodes:
        if n.op_type == "Gather" and n.input[0] in cast_of:
            cast = next(c for c in nodes if c.output[0] == n.input[0])
            rows = n.output[0] + "::rows"
            gather = helper.make_node(
                "Gather", [cast_of[n.input[0]], *n.input[1:]], [rows], name=n.name
            )
            gather.attribute.extend(n.attribute)
            out += [gather, helper.make_node("Cast", [rows], list(n.output), name=rows)]
            out[-1].attribute.extend(cast.attribute)
            continue
        kept.update(n.input)
        out.append(n)
    return [n for n in out if n.output[0] not in cast_of or n.output[0] in kept]


# ops through which the output head's rows stay columns of the result, each its own
_PER_COLUMN = {"Cast", "Identity", "Transpose", "MatMul", "Mul", "Div", "Add", "Sub", "Tanh"}


def vocab_slices(seg, head, inits):
    """How to run glue segment `seg` a slice of `head`'s rows at a time, or None.

    Applies when `head` (a [V, D] initializer of more than VOCAB_ROWS rows) reaches the
    segment's outputs only through `_PER_COLUMN` ops that keep its rows as the outputs' last
    axis (Cast, a Transpose moving them last, the right operand of MatMul, elementwise ops):
    then each slice of rows gives those columns of the outputs. → (nodes with the head's
    float32 Cast, or the head itself, read as a graph input instead; that input's name; the
    outputs computed per slice)."""
    t = inits.get(head)
    if t is None or head not in seg.weights or len(t.dims) != 2 or t.dims[0] <= VOCAB_ROWS:
        return None
    axis = {head: -2}  # where the head's rows are in each value made from it, from the end
    fed, nodes = head, []
    for n in seg.nodes:
        reads = [x for x in n.input if x in axis]
        if not reads:
            nodes.append(n)
            continue
        if n.op_type not in _PER_COLUMN:
            return None
        a = axis[reads[0]]
        if n.op_type == "Transpose":
            perm = next(h.ints for h in n.attribute if h.name == "perm")
            a = list(perm).index(len(perm) + a) - len(perm)
        elif n.op_type == "MatMul" and (n.input[0] in axis or a != -1):
            return None
        if n.op_type == "Cast" and n.input[0] == head and len(n.output) == 1:
            fed = n.output[0]
            axis[fed] = a
            continue
        axis.update(dict.fromkeys(n.output, a))
        nodes.append(n)
    derived = [x for x in seg.makes if x in axis]
    # read elsewhere than through its Cast (a float32 head is fed as itself: read anywhere)
    if any(axis[x] != -1 for x in derived) or (fed != head and any(head in n.input for n in nodes)):
        return None
    return nodes, fed, set(derived)


def head_cut(nodes, head, inits):
    """A glue segment's `nodes` that project onto the output head and then read the projection
    whole (the speculate graph: an argmax over the vocabulary, and a Gather of the head's rows
    for the drafter's first embedding) cut in two → (first, rest): first makes every value of
    the head's rows through `_PER_COLUMN` ops and what those read, so `vocab_slices` runs it a
    slice at a time; rest reads its results whole (a Gather of the head through its Cast gets
    the Cast too: `rows_before_cast` then reads the gathered rows alone). None when there is
    nothing to cut."""
    t = inits.get(head)
    if t is None or len(t.dims) != 2 or t.dims[0] <= VOCAB_ROWS:
        return None
    made = {head}
    derived = []
    for n in nodes:
        if any(x in made for x in n.input) and n.op_type in _PER_COLUMN:
            made.update(n.output)
            derived.append(n)
    producer = {o: n for n in nodes for o in n.output}
    first, stack = set(), list(derived)
    while stack:
        n = stack.pop()
        if id(n) not in first:
            first.add(id(n))
            stack += [producer[x] for x in n.input if x in producer]
    rest = [n for n in nodes if id(n) not in first]
    casts = {n.output[0]: n for n in nodes if n.op_type == "Cast" and list(n.input) == [head]}
    needed = {x for n in rest for x in n.input}
    rest = [casts[x] for x in casts if x in needed] + rest
    if not rest or len(rest) == len(nodes):
        return None
    return [n for n in nodes if id(n) in first], rest


def head_rows(checkpoint, name):
    """Checkpoint tensor `name`'s rows, VOCAB_ROWS at a time, as float32 arrays, each read
    from the shard alone (`weights.blocks.read_block`): no page of the table stays mapped,
    where a mapped read of the 31B's 2.8 GB head kept every touched page in the process's
    resident memory until the end."""
    info = checkpoint.tensors[name]
    for a in range(0, info.shape[0], VOCAB_ROWS):
        yield np.asarray(read_block(info, (slice(a, a + VOCAB_ROWS),)), np.float32)


def device_head(name, checkpoint, precision, records, keep=()):
    """`layerwise.head_slices` in the device model (`layered_precision`'s pass 3), as a host
    call: the device model of `Logits` on VOCAB_ROWS rows of the head at a time, recorded
    under "Logits"; keep: `ref.numerics.Record.key`s left in float32."""

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        mine = isinstance(module, Logits) and context.method_name == "__call__"
        if not mine or args[1].size:
            return next_fun(*args, **kwargs)
        vocab = checkpoint.tensors[name].shape[0]
        hidden = args[0]

        def run(x):
            parts = []
            for rows in head_rows(checkpoint, name):
                fn = Logits(cap=module.cap).apply
                got = probe_jit(fn, precision, {}, x, rows, records=records, prefix="Logits",
                                keep=keep)  # fmt: skip
                parts.append(got[0])
            return [jnp.concatenate(parts, axis=-1)]

        (got,) = host_call(run, [aval((*hidden.shape[:-1], vocab))], hidden)
        return got

    return interceptor
