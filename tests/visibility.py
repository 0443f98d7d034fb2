"""Which keys a query sees, decided key by key from positions, vision runs and the window in
plain Python (not `ref`'s mask): the visibility oracle of tests/codegen/kit/test_vectors.py and
test_plan.py."""

import numpy as np


def sees(qp, kp, qg, kg, window):
    """Whether a query at position qp (vision run qg) sees a key at kp (run kg)."""
    if qp < 0 or kp < 0:
        return False
    if window is not None and qp - kp >= window:
        return False
    return kp <= qp or (qg >= 0 and qg == kg)


def visible_numpy(q_pos, kv_pos, q_group=None, kv_group=None, window=None):
    """[B, S, T] bool, key by key."""
    b, s = q_pos.shape
    t = kv_pos.shape[1]
    qg = np.full((b, s), -1) if q_group is None else q_group
    kg = np.full((b, t), -1) if kv_group is None else kv_group
    out = np.zeros((b, s, t), bool)
    for i in range(b):
        for j in range(s):
            for x in range(t):
                out[i, j, x] = sees(q_pos[i, j], kv_pos[i, x], qg[i, j], kg[i, x], window)
    return out
