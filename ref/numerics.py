"""What the device computes: the float formats QAIC runs a float32 graph in, the KV cache's
storage formats, and `emulate`, which runs any `ref` function in one of them.

The device model (QAIC compiles float32 graphs with `-convert-to-fp16`): every tensor the
graph makes is stored in the compute format, and each operation computes from its stored
operands at float32 precision and rounds its result once. So a matmul or a sum accumulates
in float32 and rounds at the end (measured here: XLA:CPU's own float16 `dot` equals the
float32 dot rounded, 12,800 of 12,800 values), and an elementwise op is IEEE-rounded. A norm
or a softmax is not one operation in the exported graph: `x·x`, its mean, the `rsqrt`, the
`exp`, each is a tensor, each rounded — so `x·x` of an RMSNorm overflows float16 once
|x| > 255.9, whatever `ref.layers.rms_norm` does in float32 when called on float16 arrays. A
mean is one operation (the graph's ReduceMean), so the sum inside it is not a tensor
(`jaxpr_facts.means`).
`emulate` applies this model to the jaxpr of the float32 function, operation by operation;
running `ref` on float16 arrays instead would keep its float32 islands (`rms_norm`, the vision
pooling and standardize, `attend`'s softmax) that a graph-level conversion does not have.

KV storage (`store_kv`): the cache crosses the graph boundary as QAIC's retained state in the
`--kv-dtype` format; a step computes in the compute format and its written cache is rounded
(float16, bfloat16) or quantized and dequantized (MXINT8) before the next step reads it.

MXINT8 storage is `ref.mxint8`.
"""

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from ref import formats, jaxpr_facts, validate
from ref.jaxpr_facts import reads_any as _reads
from ref.mxint8 import mxint8_round_trip

FORMATS = {name: getattr(jnp, name) for name in formats.COMPUTE}
KV_FORMATS = formats.KV
ALIASES = formats.ALIASES


def format_name(name, allowed=tuple(FORMATS)):
    """The canonical name of a format (`fp16` → `float16`); ValueError naming the choices."""
    canonical = ALIASES.get(name, name)
    if canonical not in allowed:
        raise ValueError(
            f"format {name!r}: expected one of {', '.join(allowed)} (or {', '.join(ALIASES)})"
        )
    return canonical


def finite_max(precision):
    """The largest finite value of a compute format (65504 for float16)."""
    return float(jnp.finfo(FORMATS[format_name(precision)]).max)


def round_to(x, precision):
    """x with every float value rounded to `precision` (nearest even; beyond its range ±inf,
    below it subnormal or 0), in x's own dtype; non-float arrays unchanged. x: any shape."""
    x = jnp.asarray(x)
    target = FORMATS[format_name(precision)]
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
        return x
    return _narrowed(x, jnp.dtype(target).name)


@functools.partial(jax.jit, static_argnums=1)
def _narrowed(x, target):
    """x through `target` and back, compiled: one pass and one new array where the two
    conversions run op by op made two (`probe` rounds every tensor)."""
    return x.astype(target).astype(x.dtype)


# a concrete array of fewer values is rounded by numpy (`_rounded`)
SMALL = 1 << 16


def _rounded(x, precision):
    """`round_to` as `_eval` rounds each value: a concrete array of fewer than SMALL values
    by numpy (the same nearest-even conversion, checked on every kind of float32 bit
    pattern), where each new shape cost `_narrowed` a trace, a lowering and a compile (op by
    op, most of a small graph's tensors are new shapes); any other as `round_to`."""
    if isinstance(x, jax.core.Tracer) or np.size(x) >= SMALL:
        return round_to(x, precision)
    x = np.asarray(x)
    target = FORMATS[format_name(precision)]
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == target:
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(target).astype(x.dtype)


def store(x, kv_format):
    """x as the KV cache holds it in `kv_format` (float32, float16, bfloat16, mxint8)."""
    kv_format = format_name(kv_format, KV_FORMATS)
    if kv_format == "mxint8":
        return mxint8_round_trip(x)
    return round_to(x, kv_format)


def store_kv(cache, kv_format):
    """A KV cache ({"k": {layer: [B, Hkv, T, D]}, "v": …, other leaves}) with its keys and
    values as the device stores them in `kv_format`; position/run-id leaves unchanged."""
    return dict(
        cache,
        **{kind: {i: store(a, kv_format) for i, a in cache[kind].items()} for kind in ("k", "v")},
    )


# --- ref in a compute format: the jaxpr, operation by operation ---------------------------


@dataclasses.dataclass(frozen=True)
class Record:
    """One float tensor an operation made: where (module path, checkpoint-like), what op,
    its largest finite |value| and whether it turned non-finite there (an inf from finite
    operands, or any NaN)."""

    name: str
    primitive: str
    shape: tuple
    max_abs: float
    nonfinite: bool
    ordinal: int = 0  # its place among the tensors of this name and primitive, from 0
    kept: bool = False  # kept in float32 by a plan (`emulate`'s keep), not rounded

    @property
    def key(self):
        """The tensor's name in a plan of tensors kept in float32 (`emulate`'s `keep`):
        "module.path:primitive#ordinal", e.g. "VisionModel:sub#0"."""
        return f"{self.name}:{self.primitive}#{self.ordinal}"


def module_path(name_stack):
    """A jaxpr name stack as a checkpoint-like path: Flax class names dropped, except the
    outermost when nothing else is left (a model's own body).

    "VisionModel/encoder/layers/0/EncoderLayer/self_attn" → "encoder.layers.0.self_attn";
    "VisionModel" → "VisionModel".
    """
    parts = [p for p in str(name_stack).split("/") if p and not p.startswith(("jit(", "pjit("))]
    names = [p for p in parts if not p[0].isupper() and "." not in p]
    return ".".join(names) if names else (parts[0].split(".")[0] if parts else "")


# primitives whose body is one more jaxpr, evaluated op by op; other higher-order primitives
# (loops, conditionals) run whole and round their results
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr"}


_ARRAYS = (jax.Array, np.ndarray, np.generic)
_HOST = core.Primitive("host_call")
_HOST.multiple_results = True
_HOST.def_impl(lambda *args, fn, avals: fn(*args))
_HOST.def_abstract_eval(lambda *args, fn, avals: avals)


def host_call(fn, avals, *args):
    """fn(*args) as one operation of a traced function → its results (a list). Evaluated op
    by op (`probe`), fn is called with the values reached; its array results are rounded to
    the format but not recorded (fn probes its own work), and a result may be any other
    object with a shape (one let go, one drawn later), passed on as it is. avals: the
    results' ShapedArrays (`aval`)."""
    return _HOST.bind(*args, fn=fn, avals=tuple(avals))


def aval(shape, dtype=jnp.float32):
    """The ShapedArray of a `host_call` result."""
    return jax.core.ShapedArray(tuple(shape), jnp.dtype(dtype))


def _is_float(x):
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _all_finite(x):
    """Whether every value of x is finite (True for a non-float x); traced for a traced x
    (`ref.probe_jit`)."""
    if isinstance(x, jax.core.Tracer):
        return jnp.all(jnp.isfinite(x)) if _is_float(x) else True
    return not _is_float(x) or validate.all_finite(x)


def _all(flags):
    """all(flags), by `&`: traced when one of them is, or a flag of `ref.probe_jit`'s that
    is decided later."""
    return functools.reduce(operator.and_, flags, True)


class _Places:
    """Each float tensor's module path and ordinal (`Record.key`) in evaluation order, and
    whether a plan keeps it in float32. prefix: the module path the function runs under (a
    layer probed on its own: the operations of its own body are named by the prefix alone,
    as when the whole graph is probed)."""

    def __init__(self, keep=(), prefix=""):
        self.keep, self.prefix, self.counts = frozenset(keep), prefix, {}

    def place(self, path, primitive):
        """(module path, ordinal) of the next tensor that `primitive` makes at name stack
        `path`."""
        inner = module_path(path)
        if self.prefix and inner[:1].isupper():  # the prefixed module's own body: its class
            inner = ""
        name = ".".join(p for p in (self.prefix, inner) if p)
        ordinal = self.counts.get((name, primitive), 0)
        self.counts[(name, primitive)] = ordinal + 1
        return name, ordinal

    def kept(self, name, primitive, ordinal):
        return f"{name}:{primitive}#{ordinal}" in self.keep


def _eval(closed, args, precision, sink=None, prefix="", finite_in=None, places=None, moved=None,
          stored=()):  # fmt: skip
    """Evaluate a ClosedJaxpr with every float value rounded → its outputs (flat); each value
    is dropped after the last equation reading it; stored: indices of the args already in
    `precision`, not rounded again (rounding them changes nothing, and a compiled rounding
    is a new array of the arg's size: a 31B layer's weights, 1.9 GB). `_evaluated` says
    more."""
    return _evaluated(closed, args, precision, sink, prefix, finite_in, places, moved,
                      stored)[0]  # fmt: skip


def _evaluated(closed, args, precision, sink=None, prefix="", finite_in=None, places=None,
               moved=None, stored=(), loose=()):  # fmt: skip
    """`_eval` → (outputs (flat), the indices of those that hold float32 values the device
    does not round: a tensor a plan keeps, or a move of one inside a body). loose: indices
    of the args that hold such values, taken as they are (a body's args are the values its
    caller holds, already as the device stores them: rounding a kept one at the body's entry
    would lose what the plan keeps). sink: None, or
    sink(name, primitive, result, inputs_finite, (ordinal, kept), values) → whether result
    is all finite, called per float result of an operation (inputs_finite: every float
    operand all finite; values: an array holding result's values, `_results`); finite_in:
    that per argument, where known; places: a `_Places` (given with a sink, or to keep
    tensors in float32: their results are not rounded); moved: the traced transposes a
    `dot_general` may read through (`jaxpr_facts.folded`), shared with the bodies evaluated
    inside."""
    env, finite, unrounded = {}, {}, set()
    moved = {} if moved is None else moved

    def read(v):
        if isinstance(v, core.Literal):
            return _rounded(v.val, precision) if _is_float(v.val) else v.val
        return env[v]

    def is_finite(v):
        if isinstance(v, core.Literal):
            return _all_finite(v.val)
        if v not in finite:
            finite[v] = _all_finite(env[v])
        return finite[v]

    jaxpr = closed.jaxpr
    last, means = jaxpr_facts.last_uses(jaxpr), jaxpr_facts.means(jaxpr)
    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = _rounded(c, precision)
    for j, (v, a) in enumerate(zip(jaxpr.invars, args, strict=True)):
        env[v] = a if j in stored or j in loose else _rounded(a, precision)
        if j in loose:
            unrounded.add(v)
        if finite_in is not None:
            finite[v] = finite_in[j]
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [read(v) for v in eqn.invars]
        path = "/".join(p for p in (prefix, str(eqn.source_info.name_stack)) if p)
        body = _CALLS.get(eqn.primitive.name)
        if body is not None:
            known = None if sink is None else [is_finite(v) for v in eqn.invars]
            mine = {j for j, v in enumerate(eqn.invars) if _reads([v], unrounded)}
            outs, left = _evaluated(eqn.params[body], ins, precision, sink, path, known, places,
                                    moved, range(len(ins)), mine)  # fmt: skip
            unrounded.update(eqn.outvars[j] for j in left)
        elif eqn.primitive is _HOST:
            outs = [
                _rounded(o, precision) if isinstance(o, _ARRAYS) and _is_float(o) else o
                for o in eqn.params["fn"](*ins)
            ]
        elif i in means:  # a mean's sum: float32, as the device's ReduceMean (`jaxpr_facts.means`)
            outs = [eqn.primitive.bind(*ins, **eqn.params)]
        else:
            operands, params = jaxpr_facts.folded(eqn, ins, moved)
            made = eqn.primitive.bind(*operands, **params)
            made = made if eqn.primitive.multiple_results else [made]
            probing = (sink, places, finite, is_finite, unrounded)
            outs = _results(eqn, ins, made, precision, path, probing)
            if eqn.primitive.name == "transpose" and outs[0] is made[0]:
                jaxpr_facts.note_transpose(moved, made[0], ins[0], eqn.params["permutation"])
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
        del ins
        for v in eqn.invars:
            if not isinstance(v, core.Literal) and last.get(v) == i:
                env.pop(v, None)
                finite.pop(v, None)
    outs = [read(v) for v in jaxpr.outvars]
    return outs, [j for j, v in enumerate(jaxpr.outvars) if v in unrounded]


def _results(eqn, ins, outs, precision, path, probing):
    """An operation's results as the device stores them: each float one rounded, unless
    `places` keeps it in float32 (then it joins `unrounded`, the vars holding such values;
    a traced flag, `probe_jit`'s plan as data, selects, and joins it either way: a rounded
    value rounds to itself) or it moves a rounded operand's values; recorded by `sink` when
    given (`_eval`), with the values to take its statistics from: its operand's, for a move
    of every value of a rounded one (their extremes are the same, and a transposed weight
    need not be written out)."""
    sink, places, finite, is_finite, unrounded = probing
    operands = None
    done = []
    for v, o in zip(eqn.outvars, outs, strict=True):
        if not _is_float(o):
            done.append(o)
            continue
        name, ordinal, kept = None, None, False
        if places is not None and o.size:
            name, ordinal = places.place(path, eqn.primitive.name)
            kept = places.kept(name, eqn.primitive.name, ordinal)
        exact = eqn.primitive.name in jaxpr_facts.MOVES and not _reads(eqn.invars, unrounded)
        if isinstance(kept, jax.core.Tracer):  # a plan given as data (`probe_jit`'s mask)
            unrounded.add(v)
            o = o if exact else jnp.where(kept, o, _rounded(o, precision))
        elif kept:
            unrounded.add(v)
        elif not exact:
            o = _rounded(o, precision)
        if sink is not None and o.size:
            if operands is None:
                pairs = zip(eqn.invars, ins, strict=True)
                operands = _all(is_finite(u) for u, x in pairs if _is_float(x))
            same = exact and eqn.primitive.name in jaxpr_facts.SAME_VALUES
            values = ins[0] if same else o
            finite[v] = sink(name, eqn.primitive.name, o, operands, (ordinal, kept), values)
        done.append(o)
    return done


def first_nonfinite(records):
    """The first Record that turned non-finite, or None."""
    return next((r for r in records if r.nonfinite), None)


def _traced(fn, args):
    """(ClosedJaxpr of fn at args' shapes, fn's output tree, flat args)."""
    flat, in_tree = jax.tree_util.tree_flatten(args)
    specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in flat]

    def flat_fn(*leaves):
        return fn(*jax.tree_util.tree_unflatten(in_tree, list(leaves)))

    closed, shapes = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
    return closed, jax.tree_util.tree_structure(shapes), flat


def emulate(fn, precision, keep=()):
    """fn run as the device runs it in `precision` (module docstring): every float input,
    constant and operation result rounded to it — but the results `keep` names
    (`Record.key`s: a node-precision plan in `ref`'s terms), which stay float32 as computed
    from their rounded operands; same arguments and result tree as fn, values in fn's dtypes.
    Traceable (jit it)."""
    precision = format_name(precision)

    def run(*args):
        closed, out_tree, flat = _traced(fn, args)
        places = _Places(keep) if keep else None
        outs = _eval(closed, flat, precision, places=places)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return run


def probe(fn, precision, *args, records=None, keep=(), prefix=""):
    """fn's result in `precision` (as `emulate`, run op by op, not compiled; `keep` as
    there) and a Record per float tensor it made, in program order → (result, [Record]);
    records: a list to append them to (the one returned), e.g. shared with probes run inside
    fn's operations; prefix: the module path fn runs under (a layer probed on its own), which
    its records' names and keys start with."""
    precision = format_name(precision)
    closed, out_tree, flat = _traced(fn, args)
    records = [] if records is None else records

    def sink(name, primitive, out, operands_finite, place, values):
        values = np.asarray(values, np.float32)
        lo, hi = float(values.min()), float(values.max())  # NaN when any is (numpy's rule)
        if np.isfinite(lo) and np.isfinite(hi):  # read in place: the common case
            peak, ok, turned = max(hi, -lo), True, False
        else:
            values = np.abs(values)
            finite = np.isfinite(values)
            ok = bool(finite.all())
            turned = bool(np.isnan(values).any()) or (not ok and operands_finite)
            peak = float(values[finite].max()) if finite.any() else 0.0
        records.append(Record(name, primitive, tuple(out.shape), peak, turned, *place))
        return ok

    outs = _eval(closed, flat, precision, sink, places=_Places(keep, prefix))
    return jax.tree_util.tree_unflatten(out_tree, outs), records
