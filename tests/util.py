"""Small helpers shared by the test modules (one home each)."""

import numpy as np


def rel_err(got, want):
    """max|got − want| / max|want| in float64 (want not all zero: 1e-30 guards the division)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def vision_runs(rng, n):
    """Random contiguous vision runs over n positions: run id ≥ 0 per vision token, −1 text."""
    ids = np.full(n, -1)
    run, i = 0, 0
    while i < n:
        length = int(rng.integers(1, 5))
        if rng.random() < 0.4:
            ids[i : i + length] = run
            run += 1
        i += length
    return ids
