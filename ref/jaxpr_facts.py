"""Static facts about a jaxpr that `ref.numerics`' device model reads while it evaluates one:
where each value is last read, which sums are a mean's (one device operation), which
transposes a matmul can read through, and which operations only move values."""

import jax
import numpy as np
from jax.extend import core

# operations that only move or copy values: their result holds their operand's values, already
# in the format when their operand is (not a tensor a plan keeps in float32), and rounding it
# again changes nothing
MOVES = frozenset({"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "slice",
                   "rev", "copy", "copy_p"})  # fmt: skip
# moves whose result holds every value of their operand: the same statistics
SAME_VALUES = MOVES - {"slice"}


def reads_any(invars, found):
    """True when one of `invars` (an equation's operands) is a var in the set `found` (in
    `numerics`: the vars holding float32 values the device does not round, a plan's)."""
    return any(not isinstance(v, core.Literal) and v in found for v in invars)


def last_uses(jaxpr):
    """{var: index of the last equation reading it}; the jaxpr's outputs are read at the end."""
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, core.Literal):
                last[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, core.Literal):
            last[v] = len(jaxpr.eqns)
    return last


def means(jaxpr):
    """Indices of the equations that make a mean's sum: a `reduce_sum` read only (through
    `broadcast_in_dim`/`reshape` alone) by a `div` by its element count, a literal. The
    exported graph computes that mean as one ReduceMean (jax2onnx lowers `jnp.mean` so), which
    the device accumulates at float32 and rounds once: its sum is no tensor there, so it is
    neither rounded nor recorded here (an RMSNorm's sum of squares of a [.., 1536] row passes
    65,504 long before its mean does)."""
    readers, outs = {}, {v for v in jaxpr.outvars if not isinstance(v, core.Literal)}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, core.Literal):
                readers.setdefault(v, []).append(i)

    def only_reader(v):
        found = readers.get(v, [])
        return None if v in outs or len(found) != 1 else found[0]

    means = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "reduce_sum":
            continue
        shape = eqn.invars[0].aval.shape
        count = int(np.prod([shape[a] for a in eqn.params["axes"]]))
        chain, v, j = [i], eqn.outvars[0], only_reader(eqn.outvars[0])
        while j is not None and jaxpr.eqns[j].primitive.name in ("broadcast_in_dim", "reshape"):
            chain.append(j)
            v = jaxpr.eqns[j].outvars[0]
            j = only_reader(v)
        if j is None or jaxpr.eqns[j].primitive.name != "div":  # read by one operand alone
            continue
        div = jaxpr.eqns[j]
        by = div.invars[1]
        if (div.primitive.name == "div" and div.invars[0] is v and isinstance(by, core.Literal)
                and np.ndim(by.val) == 0 and float(by.val) == count):  # fmt: skip
            means.update(chain)
    return means


def note_transpose(moved, result, operand, permutation):
    """Note a traced, unrounded transpose (result = operand transposed by permutation) for
    `folded`; op by op, the copy is made anyway and is not held longer."""
    if isinstance(result, jax.core.Tracer):
        moved[id(result)] = (result, operand, tuple(permutation))


def folded(eqn, ins, moved):
    """A `dot_general`'s operands and parameters with each traced transpose it reads
    (`note_transpose`) folded into its dimension numbers, where its free dimensions keep
    their order: the same values, and XLA:CPU reads the weight as it is (`x @ w.T` at one
    row copied a 31B layer's weights transposed, 2 GB, and took 20× longer) → (operands,
    params)."""
    if eqn.primitive.name != "dot_general":
        return ins, eqn.params
    (lhs, rhs), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
    operands, contract, batch = list(ins), [lhs, rhs], [lhs_batch, rhs_batch]
    for side in (0, 1):
        entry = moved.get(id(ins[side]))
        if entry is None or entry[0] is not ins[side]:
            continue
        perm = entry[2]
        free = [perm[d] for d in range(len(perm)) if d not in (*contract[side], *batch[side])]
        if free != sorted(free):
            continue
        operands[side] = entry[1]
        contract[side] = tuple(perm[d] for d in contract[side])
        batch[side] = tuple(perm[d] for d in batch[side])
    numbers = ((contract[0], contract[1]), (batch[0], batch[1]))
    return operands, dict(eqn.params, dimension_numbers=numbers)
