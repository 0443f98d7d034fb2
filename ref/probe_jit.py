"""`numerics.probe` compiled: the device model of a function as one XLA program.

`probe` evaluates a jaxpr operation by operation and reads each tensor on the host: every
rounding is an array of its own, and every transposed weight an eager copy (a 31B text
layer: 2 GB of each, seconds a layer). `probe_jit` traces the same evaluation (`numerics`'s
device model, the same rounding, the same `keep`) and compiles it, with each float tensor's
statistics — its largest finite |x|, whether it turned non-finite, whether it is all finite
— as three numbers of one small extra output; the Records are made from those. Equal device
programs are compiled once (a model's layers of one kind): the key is the traced program's
text and its own constants, and the traced function's constants are arguments. A function
traced before (the same jaxpr text and name stacks, format, `stored`, and the same tensors
kept by the plan: a plan that keeps none of its tensors runs the program of no plan) is not
traced again: its program is reused and its Records named anew
(`_Places` replayed over the tensors the first trace recorded) — a layer's device program
took ~1 s of Python to trace, once per layer call.

fn must be traceable as a whole: no `numerics.host_call` inside (those run Python between
operations: `probe` them).
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core

from ref import numerics

_COMPILED = {}
_TRACED = {}  # `_run`'s key → ([(name stack path, primitive, shape)], {kept flags: program})


# a tensor of at least this many values gets the fast statistics first (`_statistics`)
LARGE = 1 << 16


def _statistics(values, operands_finite):
    """[largest finite |x| (0 when none), turned non-finite (1/0), all finite (1/0)] of one
    float tensor's values, traced (the numbers `numerics.probe`'s sink reads on the host) →
    (that row, all finite). Of LARGE values or more, its max, min and sum first: reductions
    that fuse with their operand (a select for the finite peak does not: XLA:CPU writes it
    out, 441 MB for a 31B weight), the whole answer when all three are finite (a NaN or an
    inf anywhere makes the sum so; XLA:CPU's vectorized max and min may skip a NaN); the
    rest only when not (`_full`, a conditional)."""
    a = values.astype(jnp.float32)
    if a.size < LARGE:
        return _full(a, operands_finite)
    hi, lo = jnp.max(a), jnp.min(a)
    ok = jnp.isfinite(hi) & jnp.isfinite(lo) & jnp.isfinite(jnp.sum(a))
    fast = jnp.stack([jnp.maximum(hi, -lo), 0.0, 1.0]).astype(jnp.float32)
    return lax.cond(ok, lambda a: fast, lambda a: _full(a, operands_finite)[0], a), ok


def _full(a, operands_finite):
    """`_statistics`' row of float32 values a, whatever they hold, from one reduction with two
    results: the largest finite |x| and the worst value seen (0 finite, 1 ±inf, 2 NaN). Each
    reduction is a loop XLA compiles on its own: with three or four per tensor, compiling a
    layer's device program took most of a small model's precision check."""
    finite = jnp.isfinite(a)
    zero, one, two = (np.float32(v) for v in (0, 1, 2))
    magnitude = jnp.where(finite, jnp.abs(a), zero)
    worst = jnp.where(finite, zero, jnp.where(jnp.isnan(a), two, one))
    peak, worst = lax.reduce((magnitude, worst), (zero, zero), _larger, tuple(range(a.ndim)))
    ok = worst == 0
    turned = (worst == 2) | (~ok & operands_finite)
    return jnp.stack([peak, turned, ok]).astype(jnp.float32), ok


def _larger(x, y):
    """The pairwise maximum of two (largest |x|, worst value) pairs."""
    return jnp.maximum(x[0], y[0]), jnp.maximum(x[1], y[1])


def _key(closed):
    """A compiled program's cache key: its text and the bytes of its own constants."""
    digest = hashlib.sha256()
    for c in closed.consts:
        c = np.asarray(c)
        digest.update(f"{c.dtype}{c.shape}".encode())
        digest.update(c.tobytes())
    return str(closed.jaxpr), digest.hexdigest()


def _compiled(traced):
    """The compiled program of a `jax.stages.Traced`, compiled once per `_key` (lowered
    from the trace made: jitting its jaxpr again would trace every equation a second
    time)."""
    key = _key(traced.jaxpr)
    if key not in _COMPILED:
        _COMPILED[key] = traced.lower().compile()
    return _COMPILED[key]


def _run(closed, flat, precision, places, stored=()):
    """The device model of closed at flat (those at indices `stored` already in precision),
    compiled → (outputs (flat), [(name, primitive, shape, place)] and their statistics [n, 3]
    per float tensor (`_statistics`))."""
    key = (str(closed.jaxpr), _stacks(closed.jaxpr), precision, stored)
    tensors, programs = _TRACED.get(key, (None, {}))
    placed = None if tensors is None else _replayed(tensors, places)
    kept = None if placed is None else tuple(place[1] for *_, place in placed)
    if kept not in programs:
        program, placed, tensors = _traced_device(closed, flat, precision, places, stored)
        kept = tuple(place[1] for *_, place in placed)
        _TRACED[key] = (tensors, {**programs, kept: program})
    outs, stats = _TRACED[key][1][kept](list(closed.consts), *flat)
    return list(outs), placed, np.asarray(stats)


def _stacks(jaxpr):
    """The name stacks of a jaxpr's equations, of the bodies `numerics._eval` enters too (the
    module paths Records are named by, which the jaxpr's text leaves out)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(str(eqn.source_info.name_stack))
        body = numerics._CALLS.get(eqn.primitive.name)
        if body is not None:
            out.append(_stacks(eqn.params[body].jaxpr))
    return tuple(out)


def _replayed(tensors, places):
    """[(name, primitive, shape, (ordinal, kept))] of the float tensors a traced program
    records, [(name stack path, primitive, shape)] in order, as `places` names them."""
    out = []
    for path, primitive, shape in tensors:
        name, ordinal = places.place(path, primitive)
        out.append((name, primitive, shape, (ordinal, places.kept(name, primitive, ordinal))))
    return out


class _Recording(numerics._Places):
    """`numerics._Places` that also lists each name stack path it places, in order."""

    def __init__(self, keep, prefix):
        super().__init__(keep, prefix)
        self.paths = []

    def place(self, path, primitive):
        self.paths.append(path)
        return super().place(path, primitive)


def _traced_device(closed, flat, precision, places, stored):
    """(the compiled device program of closed (`_compiled`), [(name, primitive, shape,
    place)], [(name stack path, primitive, shape)]) per float tensor it records, `places`
    naming them."""
    placed, recording = [], _Recording(places.keep, places.prefix)

    def device(consts, *leaves):
        stats = []

        def sink(name, primitive, out, operands_finite, place, values):
            numbers, ok = _statistics(values, operands_finite)
            placed.append((name, primitive, tuple(out.shape), place))
            stats.append(numbers)
            return ok

        body = core.ClosedJaxpr(closed.jaxpr, consts)
        outs = numerics._eval(body, leaves, precision, sink, places=recording, stored=stored)
        return outs, jnp.stack(stats) if stats else jnp.zeros((0, 3), jnp.float32)

    def spec(x):
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    traced = jax.jit(device).trace([spec(c) for c in closed.consts], *map(spec, flat))
    pairs = zip(recording.paths, placed, strict=True)
    tensors = [(path, primitive, shape) for path, (_, primitive, shape, _) in pairs]
    return _compiled(traced), placed, tensors


def probe_jit(fn, precision, *args, records=None, keep=(), prefix="", stored=()):
    """As `numerics.probe` (same arguments, same result and Records), compiled. stored:
    indices of args (each an array) whose values are already in `precision` (`round_to`
    changes none of them: weights rounded where they were read), given to the program as they
    are where it would round them into a new array."""
    precision = numerics.format_name(precision)
    closed, out_tree, flat = numerics._traced(fn, args)
    if stored and len(flat) != len(args):
        raise ValueError(f"probe_jit: stored={sorted(stored)} indexes args, but they are not "
                         f"all arrays ({len(args)} args, {len(flat)} leaves)")  # fmt: skip
    records = [] if records is None else records
    places = numerics._Places(keep, prefix)
    outs, placed, stats = _run(closed, flat, precision, places, frozenset(stored))
    for (name, primitive, shape, place), (peak, turned, *_) in zip(placed, stats, strict=True):
        records.append(numerics.Record(name, primitive, shape, float(peak), bool(turned), *place))
    return jax.tree_util.tree_unflatten(out_tree, outs), records
