"""The layer calls of a plan's `ref` pairing replayed from its last run (`layered_precision.
ref_first`): each pairing runs `ref`'s device model from the graph's start again, with one
more tensor kept, and every layer call before the one that overflowed gets the same inputs
and keeps the same tensors, so its results and Records are those of the run before. A call
whose inputs (by content) and kept tensors match the last run's call at the same place is
not run: its Records are appended again and its results returned (E2B's tower: three nodes
after its last layer, each pairing ran all 16 layers again)."""

import hashlib

import numpy as np

# results held for replay, in all: above it, a call's results are not kept (it runs again)
REPLAY_BYTES = 1 << 31


def kept_in(path, keep):
    """The keys of `keep` (`ref.numerics.Record.key`s) that name a tensor of the layer at
    module path `path` (its own, or a submodule's), sorted."""
    return tuple(sorted(k for k in keep if k.split(":")[0] == path
                        or k.startswith(f"{path}.")))  # fmt: skip


def digest(arrays):
    """A digest of arrays' types, shapes and bytes, or None when one is not an array."""
    h = hashlib.blake2b(digest_size=32)
    for a in arrays:
        if not hasattr(a, "__array__"):
            return None
        a = np.asarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    return h.hexdigest()


class Replay:
    """The last run's layer calls: {call index: (key, Records, results)}."""

    def __init__(self, limit=REPLAY_BYTES):
        self.calls, self.limit = {}, limit

    def key(self, path, arrays, keep):
        """The key of a call at module path `path` on inputs `arrays` with the plan `keep`:
        None when it cannot be replayed (an input that is not an array)."""
        got = digest(arrays)
        return None if got is None else (path, got, kept_in(path, keep))

    def get(self, k, key):
        """(Records, results) of call k in the last run when its key was `key`, or None."""
        found = self.calls.get(k)
        return None if key is None or found is None or found[0] != key else found[1:]

    def put(self, k, key, records, made):
        """Hold call k's Records and results `made` under `key`, if they fit the limit."""
        self.calls.pop(k, None)
        held = sum(_nbytes(m) for _, _, ms in self.calls.values() for m in ms)
        if key is not None and held + sum(_nbytes(m) for m in made) <= self.limit:
            self.calls[k] = (key, list(records), tuple(made))


def _nbytes(x):
    return int(getattr(x, "nbytes", 0)) if hasattr(x, "__array__") else 0
