"""`verify` by layer function: the glue and one call of each distinct layer function checked
numerically, every call's bindings proven (`codegen.check.bindings`).

A lowering bug lives in a function's body, which every call of it shares; a wiring bug in a
call's bindings. So a graph whose calls outnumber its functions is checked (by default at
released sizes, `BY_FUNCTION_BYTES`; `--by-function` asks for it at any size) as: the proof,
from the graph and the checkpoint's headers alone, that every call binds its own layer's
weights and inputs as `ref`'s composition does; then the layer-by-layer check
(`layerwise.verify_specialization`) of one call per function, chosen by the seed
(`chosen_calls`), against `ref` with that layer's real weights, and of all the glue. Every
other call is stood in for on both sides by the same values (`StandIns`): random results of its
results' shapes, its weights never read, its caches never drawn, so the calls checked and the
glue see inputs `ref` and onnxruntime share. A stood-in hidden state is its input plus a
standard normal draw (`Plus`), as a residual layer adds its branches to its input, so a checked
call deep in the stack reads a residual stream of about the scale a real one has there
(verify's bound is relative to the largest output value: on draws of scale 1, E2B's
FullSharedDecoderLayer at production shapes measured 1.6e-5 to 1.9e-5 against 1e-5; on the
grown stream 6.3e-6 at most, as layer by layer). `--exhaustive` checks every call instead.
"""

import dataclasses
import zlib

import jax
import numpy as np

from codegen import graphs
from codegen.check import bindings
from codegen.check.layer_buffers import float32_bytes, signature
from codegen.graphs import kinds

# Graphs whose float32 weights exceed this are checked by layer function by default when they
# call a function more than once (as `verify.LAYERWISE_BYTES`: every released size).
BY_FUNCTION_BYTES = 256 << 20
BY_DEFAULT = True  # False: only `--by-function` asks for it


def use_by_function(spec, model, checkpoint, calls=None):
    """True when `verify` checks this graph by layer function: calls "one" (asked for), or by
    default (calls None, when BY_DEFAULT) when its calls outnumber its distinct functions and
    its float32 weights exceed BY_FUNCTION_BYTES; calls "every": never."""
    if calls is not None:
        return calls == "one"
    if not BY_DEFAULT:
        return False
    n, distinct = bindings.summary(model)
    return n > distinct and float32_bytes(spec, checkpoint) > BY_FUNCTION_BYTES


def chosen_calls(model, seed, graph):
    """{function name: the index among the graph's layer calls of the one call checked},
    drawn uniformly among each function's calls from `seed` and the graph's name."""
    calls = bindings.layer_calls(model)
    rng = np.random.default_rng([seed, zlib.crc32(graph.encode())])
    out = {}
    for fn in sorted(set(calls)):
        mine = [k for k, c in enumerate(calls) if c == fn]
        out[fn] = mine[int(rng.integers(len(mine)))]
    return out


def described(chosen, model):
    """The calls checked as text: "SlidingDecoderLayer at call 3 (1 of its 50), …"."""
    calls = bindings.layer_calls(model)
    return ", ".join(
        f"{fn} at call {k} (1 of its {calls.count(fn)})" for fn, k in sorted(chosen.items())
    )


def proof_row(entry, model, folder, checkpoint, log):
    """The verify row of the bindings proof (`bindings.faults`): (specialization "all",
    output "bindings", faults, 0.0, where, ok); log(line) names every fault."""
    shapes = {n: i.shape for n, i in checkpoint.tensors.items()}
    try:
        spec = kinds.build(entry.kind, entry.name, checkpoint.config, shapes, entry.options,
                           use_functions=True)  # fmt: skip
    except kinds.KindError as e:
        return ("all", "bindings", 1.0, 0.0, str(e), False)
    found = bindings.faults(spec, model, folder, checkpoint)
    for line in found:
        log(f"  {entry.name}: {line}")
    n, distinct = bindings.summary(model)
    where = found[0] if found else f"{n} calls of {distinct} functions bound as ref binds them"
    return ("all", "bindings", float(len(found)), 0.0, where, not found)


def residual(avals, arrays):
    """The index of the result a stood-in call adds its draw to its first input in (a layer's
    hidden state: the first float32 result shaped as its first input), or None."""
    if not arrays or isinstance(arrays[0], graphs.Drawn):  # a cache, drawn when read
        return None
    if np.dtype(arrays[0].dtype) != np.float32:
        return None
    first = tuple(arrays[0].shape)
    for r, a in enumerate(avals):
        if tuple(a.shape) == first and np.dtype(a.dtype) == np.float32:
            return r
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class Plus:
    """`Drawn.then` of a stood-in hidden state: base + the draw, as a residual layer adds its
    branches to its input. base: [*shape] float32."""

    base: np.ndarray

    def __call__(self, x):
        x += self.base
        return x


class StandIns:
    """The values a call not checked gives on both sides: its results' shapes and types
    (`jax.eval_shape` of the layer, once per function and input shapes, weights as shapes
    from the checkpoint's headers), drawn from the seed and the call's index."""

    def __init__(self, seed, checkpoint):
        self.seed, self.checkpoint, self.shapes = seed, checkpoint, {}
        self.checked = set()  # (function, its inputs' shapes and types) checked

    def checked_before(self, kind, arrays):
        """True when a call of function `kind` was checked on inputs of these shapes and types
        already (at an earlier specialization of the graph: prefill's image budgets share
        seq_len, so its layer calls share shapes); else records them and gives False."""
        key = (kind, signature(arrays))
        if key in self.checked:
            return True
        self.checked.add(key)
        return False

    def _avals(self, kind, slot, arrays, names):
        """(results' ShapeDtypeStructs, out_map, outputs' tree) of `slot` on `arrays`."""
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
        params = [jax.ShapeDtypeStruct(self.checkpoint.tensors[n].shape, np.float32) for n in names]
        key = (kind, signature(args))
        if key not in self.shapes:
            found = {}

            def body(*a):
                distinct, found["map"], found["tree"] = slot.results(list(a))
                return distinct

            avals = jax.eval_shape(body, *args, *params)
            self.shapes[key] = (avals, found["map"], found["tree"])
        return self.shapes[key]

    def results(self, k, kind, slot, arrays, names):
        """(arrays, each one the call passes through drawn; stand-in results: `Drawn` for
        float32, zeros otherwise; out_map; outputs' tree) of call k, whose weights are
        checkpoint `names`."""
        avals, out_map, tree = self._avals(kind, slot, arrays, names)
        made = [
            graphs.Drawn(tuple(a.shape), (self.seed, 1 + k, r))
            if np.dtype(a.dtype) == np.float32
            else np.zeros(a.shape, a.dtype)
            for r, a in enumerate(avals)
        ]
        r = residual(avals, arrays)
        if r is not None:
            made[r] = dataclasses.replace(made[r], then=Plus(np.array(graphs.drawn(arrays[0]))))
        drawn = {j for src, j in out_map if src == "in"}  # passed through: `ref` reads it
        arrays = [graphs.drawn(a) if j in drawn else a for j, a in enumerate(arrays)]
        return arrays, made, out_map, tree
