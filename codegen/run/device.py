"""The device's rules, as the runtime holds itself to them: the one seam between the runner
and the engine under it (onnxruntime, standing in for a QAIC card).

On QAIC one exported graph compiles to one program (QPC). A program runs only at the shapes
its specializations.json lists, and with `-retained-state` each `X` / `X_RetainedState`
pair is device memory the program owns: it persists across the program's calls and
specializations, and crosses PCIe only when the host binds a buffer for it, the whole buffer
(QEfficient's `QAICInferenceSession`: `skip_buffers` leaves it on the device, `set_buffers`
writes all of it; there is no write of one slot's rows from the host).

`Program` holds a graph to those rules: it keeps its retained state to itself, refuses a
call whose inputs match none of its specializations (naming the shapes it has, as
QEfficient's session refuses them), and hands its state to the host only through
`read_state` / `write_state`, the declared handoff. `Transfers` counts every byte that
crosses: per kind of call, in and out, as KV (retained state, in the export's KV format),
logits, or other.
"""

import collections
import dataclasses

import numpy as np

from codegen.run.errors import RunError

# bytes per element of the retained state as the device stores it (custom_io.yaml's
# Precision): MXINT8 holds 32 int8 elements and one 8-bit shared scale per block
KV_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "mxint8": 33 / 32}
WHAT = ("kv", "logits", "other")  # what crosses, as `Transfers` sorts it


def kv_element_bytes(kv_dtype):
    """Bytes per element of a retained-state tensor stored as `kv_dtype`."""
    if kv_dtype not in KV_BYTES:
        raise RunError(f"kv dtype {kv_dtype!r}: expected one of {sorted(KV_BYTES)}")
    return KV_BYTES[kv_dtype]


def matching(specializations, feed):
    """The name of the specialization ({name: {input: shape}}) whose input shapes `feed` has
    exactly, else None."""
    given = {n: tuple(np.shape(x)) for n, x in feed.items()}
    return next((name for name, shapes in specializations.items() if shapes == given), None)


@dataclasses.dataclass
class Transfers:
    """Bytes across PCIe: `moved[(call, direction, what)]`, direction "in" (host → device) or
    "out"; `calls[call]`: the calls of each kind. A handoff of retained state is its own kind
    of call ("handoff prefill→decode")."""

    moved: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, call, direction, what, nbytes):
        """Count `nbytes` of `what` moved in `direction` by a call of kind `call`."""
        self.moved[(call, direction, what)] += nbytes

    def total(self, what=None, direction=None):
        """Bytes moved, of one `what` and/or one direction (None: all)."""
        return sum(n for (_, d, w), n in self.moved.items()
                   if what in (None, w) and direction in (None, d))  # fmt: skip

    def table(self, requests, tokens):
        """Lines: per kind of call, its count and bytes in and out (KV, logits, other); then
        the totals, per request and per generated token."""
        kinds = list(dict.fromkeys(c for c, _, _ in self.moved))
        head = f"{'call':<26} {'calls':>6}" + "".join(
            f" {d + ' ' + w:>14}" for d in ("in", "out") for w in WHAT
        )
        lines = [head]
        for kind in kinds:
            cells = "".join(f" {self.moved[(kind, d, w)]:>14,.0f}"
                            for d in ("in", "out") for w in WHAT)  # fmt: skip
            lines.append(f"{kind:<26} {self.calls[kind]:>6}{cells}")
        for label, n in (("total", 1), ("per request", requests), ("per generated token", tokens)):
            cells = "".join(f" {self.total(w, d) / max(n, 1):>14,.0f}"
                            for d in ("in", "out") for w in WHAT)  # fmt: skip
            lines.append(f"{label:<26} {'':>6}{cells}")
        return lines


class Program:
    """One compiled program: an engine session (onnxruntime) on a graph, at the shapes of its
    specializations, owning its retained state (zeros at load, as the device's buffers; held
    as read-only arrays that the program replaces, never writes into)."""

    def __init__(self, name, entry, session, transfers, kv_dtype="float16"):
        """entry: the graph's manifest entry (`codegen.folder.manifest.Graph`); session: its
        engine (anything with onnxruntime's `run` and `get_outputs`)."""
        self.name, self.session, self.transfers = name, session, transfers
        self.kv_bytes = kv_element_bytes(kv_dtype)
        self.retained = {i: o for i, o in entry.retained_state}
        shapes = {s["name"]: entry.shapes(s["name"]) for s in entry.specializations}
        first = next(iter(shapes.values()))
        self.state_shapes = {n: first[n] for n in self.retained}
        self.specializations = {s: {n: x for n, x in sh.items() if n not in self.retained}
                                for s, sh in shapes.items()}  # fmt: skip
        self.state = {n: np.broadcast_to(np.float32(0), s) for n, s in self.state_shapes.items()}

    def specialization(self, feed):
        """The name of the specialization whose input shapes `feed` has exactly; RunError
        naming every shape the program has otherwise."""
        name = matching(self.specializations, feed)
        if name is not None:
            return name
        given = {n: tuple(np.shape(x)) for n, x in feed.items()}
        have = "; ".join(f"{n}: {shapes}" for n, shapes in self.specializations.items())
        raise RunError(f"program {self.name}: no specialization takes {given}; it has {have}")

    def run(self, call, feed, observe=None):
        """One call of kind `call` on `feed` (every input but the retained state) → its outputs
        but the retained state, which stays in the program. observe(feed): told the whole
        feed, retained state included (host-side instrumentation: no device has it)."""
        inside = sorted(set(feed) & set(self.retained))
        if inside:
            raise RunError(
                f"program {self.name}: {inside[0]} is retained state, held on the device; "
                "hand it over with write_state, not as a call's input"
            )
        self.specialization(feed)
        whole = {**feed, **self.state}
        if observe is not None:
            observe(whole)
        names = [o.name for o in self.session.get_outputs()]
        out = dict(zip(names, self.session.run(None, whole), strict=True))
        self.transfers.calls[call] += 1
        for x in feed.values():
            self.transfers.add(call, "in", "other", np.asarray(x).nbytes)
        for i, o in self.retained.items():
            self.state[i] = out.pop(o)
        for n, x in out.items():
            self.transfers.add(call, "out", "logits" if n == "logits" else "other", x.nbytes)
        return out

    def read_state(self, call):
        """The whole retained state, on the host (counted as `call`'s KV out): the arrays
        themselves, which the program replaces at its next call and never writes into."""
        self.transfers.calls[call] += 1
        for x in self.state.values():
            self.transfers.add(call, "out", "kv", x.size * self.kv_bytes)
        return dict(self.state)

    def write_state(self, call, arrays):
        """Replace the whole retained state with `arrays` from the host (counted as `call`'s
        KV in): every retained input, at its shape, as `set_buffers` writes it."""
        shapes = {n: tuple(np.shape(x)) for n, x in arrays.items()}
        if shapes != self.state_shapes:
            raise RunError(f"program {self.name}: retained state {shapes}; expected "
                           f"{self.state_shapes} (the whole buffers)")  # fmt: skip
        for x in arrays.values():
            self.transfers.add(call, "in", "kv", x.size * self.kv_bytes)
        self.state = {n: np.asarray(x, np.float32) for n, x in arrays.items()}


class ShapeOnly:
    """An engine that computes nothing: each output is zeros of its declared shape at the
    call's specialization (zero-strided: no memory). Bytes crossing the host depend on shapes
    and the schedule only, so it counts a released model's transfers where onnxruntime would
    need its weights (`benchmarks/device_transfers.py`); greedy tokens are all id 0."""

    def __init__(self, entry, folder=None, checkpoint=None):
        """entry: the graph's manifest entry (folder and checkpoint, as `open_session` takes
        them, are not read)."""
        self.entry = entry

    def get_outputs(self):
        """The outputs (each with its `name`, as onnxruntime's `NodeArg`s)."""
        return list(self.entry.outputs)

    def run(self, _, feed):
        """[zeros] in output order at the specialization whose input shapes `feed` has."""
        shapes = {s["name"]: self.entry.shapes(s["name"]) for s in self.entry.specializations}
        name = matching(shapes, feed)
        if name is None:
            given = {n: tuple(np.shape(x)) for n, x in feed.items()}
            raise RunError(f"graph {self.entry.name}: no specialization takes {given}")
        dtypes = {"int32": np.int32, "int64": np.int64}
        return [np.broadcast_to(dtypes.get(t.dtype, np.float32)(0), tuple(t.shapes[name]))
                for t in self.entry.outputs]  # fmt: skip
