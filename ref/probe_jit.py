"""`numerics.probe` compiled: the device model of a function as one XLA program.

`probe` evaluates a jaxpr operation by operation and reads each tensor on the host: every
rounding is an array of its own, and every transposed weight an eager copy (a 31B text
layer: 2 GB of each, seconds a layer). `probe_jit` traces the same evaluation (`numerics`'s
device model, the same rounding, the same `keep`) and compiles it, with each float tensor's
statistics — its largest finite |x|, whether it turned non-finite, whether it is all finite
— as three numbers of one small extra output; the Records are made from those. Equal device
programs are compiled once (a model's layers of one kind): the key is the traced program's
text and its own constants, and the traced function's constants are arguments. A function
traced before (the same jaxpr text and name stacks, format and `stored`) is not traced
again: its program is reused and its Records named anew (`_Places` replayed over the
tensors the first trace recorded) — a layer's device program took ~1 s of Python to trace,
once per layer call. A plan is data: a function has the program of no plan, and one that
takes a flag per tensor (kept or rounded, a select) for any plan that keeps one of its
tensors.

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
_TRACED = {}  # `_run`'s key → ([(name stack path, primitive, shape)], {plan as data: program})


# a tensor of at least this many values gets the fast statistics first (`_Batch.add`)
LARGE = 1 << 16


class _Flag:
    """Whether some tensors are all finite, decided when the program's statistics are
    (`_Batch.stats`): the tensors' indices (in the order the sink saw them) and traced flags
    of other values (an argument's), all of which must hold. `&` joins two (as
    `numerics._all` does); it has no truth value while tracing."""

    __array_ufunc__ = None  # numpy defers `&` to `__rand__`

    def __init__(self, tensors=frozenset(), traced=()):
        self.tensors, self.traced = frozenset(tensors), tuple(traced)

    def __and__(self, other):
        if isinstance(other, _Flag):
            return _Flag(self.tensors | other.tensors, self.traced + other.traced)
        if other is True:
            return self
        return _Flag(self.tensors, (*self.traced, jnp.asarray(other)))

    __rand__ = __and__

    def __bool__(self):
        raise TypeError("a tensor's finiteness is known only once the program's statistics are")


class _Batch:
    """Every float tensor's statistics in one program, taken together at its end: the
    largest finite |x| and the worst value (0 finite, 1 ±inf, 2 NaN) of all tensors under
    LARGE values by one segmented reduction over their values laid end to end, and whether
    it turned non-finite from its operands' flags by one more (`_Flag`). A reduction per
    tensor was a loop XLA compiled on its own: most of a layer's compile time (2.5 s of a
    small layer's 3 s)."""

    def __init__(self):
        self.small, self.large, self.operands = [], [], []

    def add(self, values, operands_finite):
        """Record one tensor's values (and whether its float operands are all finite: a
        bool, a traced flag or a `_Flag`) → its own `_Flag`."""
        k = len(self.operands)
        a = values.astype(jnp.float32)
        if a.size < LARGE:
            self.small.append((k, a.reshape(-1)))
        else:
            self.large.append((k, *_large(a)))
        self.operands.append(operands_finite)
        return _Flag({k})

    def stats(self):
        """[n, 3]: per tensor [largest finite |x| (0 when none), turned non-finite (1/0), all
        finite (1/0)], the numbers `numerics.probe`'s sink reads on the host."""
        n = len(self.operands)
        if n == 0:
            return jnp.zeros((0, 3), jnp.float32)
        peak, worst = jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.float32)
        if self.small:
            at = np.array([k for k, _ in self.small])
            p, w = _segmented([a for _, a in self.small])
            peak, worst = peak.at[at].set(p), worst.at[at].set(w)
        if self.large:
            at = np.array([k for k, *_ in self.large])
            peak = peak.at[at].set(jnp.stack([p for _, p, _ in self.large]))
            worst = worst.at[at].set(jnp.stack([w for *_, w in self.large]))
        ok = worst == 0
        turned = (worst == 2) | (~ok & self._operands_ok(ok))
        return jnp.stack([peak, turned, ok], axis=1).astype(jnp.float32)

    def _operands_ok(self, ok):
        """[n] bool: each tensor's float operands all finite, from `ok` [n] (each tensor's
        own) and the traced flags its `_Flag` holds."""
        flags, into, source = list(ok), [], []
        for k, given in enumerate(self.operands):
            given = given if isinstance(given, _Flag) else _Flag() & given
            into += [k] * (len(given.tensors) + len(given.traced))
            source += sorted(given.tensors)
            source += range(len(flags), len(flags) + len(given.traced))
            flags += [jnp.asarray(f) for f in given.traced]
        if not into:
            return jnp.ones(len(self.operands), bool)
        bad = ~jnp.stack(flags)[np.array(source)]
        seen = jax.ops.segment_max(bad.astype(jnp.int32), np.array(into), len(self.operands))
        return seen <= 0  # no operand, or none of them bad


def _segmented(arrays):
    """(largest finite |x|, worst value) per array of float32 values, [len(arrays)] each: the
    arrays laid end to end, two segmented maxima."""
    sizes = np.array([a.size for a in arrays])
    values = jnp.concatenate(lax.optimization_barrier(list(arrays)))
    starts = np.cumsum(sizes)[:-1]
    marks = lax.optimization_barrier(jnp.zeros(values.size, jnp.int32))  # not folded by XLA
    segment = jnp.cumsum(marks.at[starts].add(1))
    finite = jnp.isfinite(values)
    magnitude = jnp.where(finite, jnp.abs(values), np.float32(0))
    code = jnp.where(finite, np.float32(0), jnp.where(jnp.isnan(values), np.float32(2), 1))
    peak = jax.ops.segment_max(magnitude, segment, len(arrays), indices_are_sorted=True)
    worst = jax.ops.segment_max(code, segment, len(arrays), indices_are_sorted=True)
    return peak, worst


def _large(a):
    """(largest finite |x|, worst value) of float32 values a of LARGE values or more: its max,
    min and sum first, reductions that fuse with their operand (a select for the finite
    peak does not: XLA:CPU writes it out, 441 MB for a 31B weight), the whole answer when
    all three are finite (a NaN or an inf anywhere makes the sum so; XLA:CPU's vectorized
    max and min may skip a NaN); the rest only when not (a conditional)."""
    hi, lo = jnp.max(a), jnp.min(a)
    ok = jnp.isfinite(hi) & jnp.isfinite(lo) & jnp.isfinite(jnp.sum(a))
    fast = (jnp.maximum(hi, -lo), np.float32(0))
    return lax.cond(ok, lambda a: fast, _full, a)


def _full(a, axes=None):
    """(largest finite |x|, worst value) of float32 values a, whatever they hold, from one
    reduction with two results, over `axes` (None: all)."""
    finite = jnp.isfinite(a)
    zero, one, two = (np.float32(v) for v in (0, 1, 2))
    magnitude = jnp.where(finite, jnp.abs(a), zero)
    worst = jnp.where(finite, zero, jnp.where(jnp.isnan(a), two, one))
    axes = tuple(range(a.ndim)) if axes is None else axes
    return lax.reduce((magnitude, worst), (zero, zero), _larger, axes)


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
    per float tensor (`_statistics`)). Two programs per traced function: the plain one, run
    whenever the plan keeps none of its tensors, and one that takes the plan as data (a flag
    per tensor: a plan search adds a kept tensor a run, and each set of them compiled a
    program of its own, seconds each). The plan as data is a select per tensor, which XLA:CPU
    does not fuse: an E4B vision layer at budget 1120 (10,080 patches, 3 × 3 tiles) held
    10.8 GB and took 36 s that way, 4.7 GB and 25 s plain, so a plan search runs it only for
    the functions its plan reaches."""
    key = (str(closed.jaxpr), _stacks(closed.jaxpr), precision, stored)
    if key not in _TRACED:
        program, tensors = _traced_device(closed, flat, precision, places.prefix, stored)
        _TRACED[key] = (tensors, {False: program})
    tensors, programs = _TRACED[key]
    placed = _replayed(tensors, places)
    kept = np.array([k for *_, (_, k) in placed], bool)
    consts = list(closed.consts)
    if not kept.any():
        outs, stats = programs[False](consts, *flat)
    else:
        if True not in programs:
            programs[True] = _traced_device(closed, flat, precision, places.prefix, stored,
                                            kept)[0]  # fmt: skip
        outs, stats = programs[True](consts, kept, *flat)
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
    """`numerics._Places` that lists each name stack path it places, in order, and keeps no
    tensor, or those a traced flag per tensor (`mask`, in that order) says."""

    def __init__(self, prefix, mask=None):
        super().__init__((), prefix)
        self.paths, self.mask = [], mask

    def place(self, path, primitive):
        self.paths.append(path)
        return super().place(path, primitive)

    def kept(self, name, primitive, ordinal):
        return False if self.mask is None else self.mask[len(self.paths) - 1]


class _Lazy:
    """A traced program compiled at its first call (`_compiled`)."""

    def __init__(self, traced):
        self.traced, self.program = traced, None

    def __call__(self, *args):
        if self.program is None:
            self.program = _compiled(self.traced)
        return self.program(*args)


def _traced_device(closed, flat, precision, prefix, stored, kept=None):
    """(closed's device program, compiled at its first call (`_Lazy`), [(name stack path,
    primitive, shape)] per float tensor it records). kept: None (a program keeping no tensor)
    or a flag per tensor (the program then takes them as its second argument)."""
    recording = _Recording(prefix)
    shapes = []

    def device(consts, *leaves):
        if kept is not None:
            recording.mask, leaves = leaves[0], leaves[1:]
        batch = _Batch()

        def sink(name, primitive, out, operands_finite, place, values):
            shapes.append((primitive, tuple(out.shape)))
            return batch.add(values, operands_finite)

        body = core.ClosedJaxpr(closed.jaxpr, consts)
        outs = numerics._eval(body, leaves, precision, sink, places=recording, stored=stored)
        return outs, batch.stats()

    def spec(x):
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))

    flags = () if kept is None else (spec(kept),)
    traced = jax.jit(device).trace([spec(c) for c in closed.consts], *flags, *map(spec, flat))
    pairs = zip(recording.paths, shapes, strict=True)
    return _Lazy(traced), [(path, primitive, shape) for path, (primitive, shape) in pairs]


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
