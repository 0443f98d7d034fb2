"""Host-side refusals of bad input at the public entry points, each naming the first bad value.

They read only concrete arrays: under a trace (jit, export) the values are unknown and the
checks pass through, so compiled and exported code costs nothing for them.
"""

import jax
import jax.numpy as jnp
import numpy as np

CHUNK = 1 << 22  # values of a host array checked at a time


def _host(x):
    """x as a numpy array, or None when it is absent or traced."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _first(bad):
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))


@jax.jit
def _finite_reduced(x):
    return jnp.isfinite(x).all()


def all_finite(x):
    """True when array x is all finite, found without a host copy or a mask of x's size (a
    large jax array: one fused reduction; else CHUNK values at a time); False when not."""
    if isinstance(x, jax.Array) and x.size > CHUNK:
        # evaluated now even where a trace is being made around it (a concrete array read
        # inside `lax.map`'s body would otherwise give a traced answer)
        with jax.ensure_compile_time_eval():
            return bool(_finite_reduced(x))
    flat = np.asarray(x).reshape(-1)
    return all(np.isfinite(flat[a : a + CHUNK]).all() for a in range(0, flat.size, CHUNK))


def finite(name, x):
    """Raise ValueError at the first NaN or infinity of a float array."""
    if x is None or isinstance(x, jax.core.Tracer):
        return
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    if np.dtype(x.dtype).kind not in "fc" or all_finite(x):
        return
    a = np.asarray(x)
    bad = ~np.isfinite(a)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{name}{list(i)} = {a[i]}: expected finite values")


def token_ids(name, ids, vocab_size, *, valid=None):
    """Raise ValueError at the first id outside [0, vocab_size) (where `valid`, if given)."""
    a = _host(ids)
    if a is None:
        return
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} has dtype {a.dtype}: expected integer token ids")
    bad = (a < 0) | (a >= vocab_size)
    if valid is not None:
        bad &= np.asarray(valid, bool)
    if bad.any():
        i = _first(bad)
        raise ValueError(f"{name}{list(i)} = {a[i]}: expected a token id in [0, {vocab_size})")


def positions(name, pos, limit=None):
    """Raise ValueError at the first position below −1 (−1 = padding) or, given `limit`, at or
    past it (a cache of `limit` slots cannot hold it: its write would be dropped)."""
    a = _host(pos)
    if a is None:
        return
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} has dtype {a.dtype}: expected integer positions")
    bad = a < -1
    if limit is not None:
        bad |= a >= limit
    if bad.any():
        i = _first(bad)
        upper = "" if limit is None else f" and < {limit} (the cache's slots)"
        raise ValueError(f"{name}{list(i)} = {a[i]}: expected −1 (padding) or ≥ 0{upper}")
