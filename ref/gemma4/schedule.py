"""The host-side prefill schedule, in numpy alone (no JAX: the runner imports it): each row's
vision runs, its chunks, and the arrays of one chunk step. `Gemma4.generate`, the onnxruntime
runner (`codegen.runtime`) and the tests drive prefill with these.
"""

import numpy as np


def image_runs(ids, *token_ids):
    """(start, length) of each contiguous run of vision tokens — any of `token_ids`: the image
    token, the video token (one run per frame) — in a row. ids: [L]."""
    is_image = np.concatenate([[False], np.isin(np.asarray(ids), token_ids), [False]])
    edges = np.flatnonzero(is_image[1:] != is_image[:-1])
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def chunk_bounds(length, runs, chunk_size, max_vision=None):
    """Half-open chunks covering [0, length): at most chunk_size tokens, never splitting an
    image run — a run that does not fit ends the chunk before it, and a run longer than
    chunk_size gets a chunk of its own — and, with max_vision, at most max_vision tokens of
    runs per chunk (a run past it starts the next chunk; one run alone is never cut).

    An image run attends to itself bidirectionally, so its first tokens need its last ones:
    prefilled across two chunks, the first part would be computed without the second.
    """
    if chunk_size is None:
        return [(0, length)]
    run_of = np.full(length + 1, -1)
    for i, (a, n) in enumerate(runs):
        run_of[a : a + n] = i
    bounds, start = [], 0
    while start < length:
        end = min(start + chunk_size, length)
        r = run_of[end]
        if end < length and r >= 0 and run_of[end - 1] == r:
            a, n = runs[r]
            end = a if a > start else a + n
        if max_vision is not None:
            end = _vision_cut(runs, start, end, max_vision)
        bounds.append((start, end))
        start = end
    return bounds


def _vision_cut(runs, start, end, max_vision):
    """The end of chunk [start, end) cut before the first run that takes its run tokens past
    max_vision (not before a run at `start`)."""
    total = 0
    for a, n in runs:
        if start <= a < end:
            if total + n > max_vision and a > start:
                return a
            total += n
    return end


def chunk_arrays(rows, schedule, k, batch, width):
    """Step k of the rows' chunk schedules → (ids [batch, width] int32, positions [batch,
    width] int32): row i's k-th chunk left-aligned with its positions, −1 past it and for a
    row with no k-th chunk (or past the rows). rows: token-id sequences; schedule: each row's
    `chunk_bounds`."""
    ids = np.zeros((batch, width), np.int32)
    pos = np.full((batch, width), -1, np.int32)
    for i, bounds in enumerate(schedule):
        if k < len(bounds):
            s, e = bounds[k]
            ids[i, : e - s], pos[i, : e - s] = rows[i][s:e], np.arange(s, e)
    return ids, pos


def prompt_lengths(lengths, batch, width):
    """Each row's prompt length of right-padded rows [batch, width]: `lengths` checked, or
    width for every row (None) → [batch] ints."""
    if lengths is None:
        return np.full(batch, width)
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > width:
        raise ValueError(f"lengths={lengths.tolist()}: expected {batch} values in [1, {width}]")
    return lengths
