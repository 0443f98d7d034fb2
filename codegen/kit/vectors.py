"""Golden vectors for kernel authors: one op's inputs and ref's outputs, written to a folder.

`python -m codegen vectors --op OP [--mode M] [--opt k=v ...] --out DIR [--seed N] [--fp16]
[--bf16]` writes DIR/vectors.safetensors — the inputs under ref's argument names, `out_f64`,
`out_f32` (and `out_f16` / `out_bf16` with the inputs copied as `q_f16`, … on request) — and
DIR/vectors.json: shapes, dtypes, layouts, options, seed, the tolerance rule with ref's own
error in each precision, and the command that writes the same bytes again.

Inputs are drawn once in float64 (numpy, seeded) and rounded to the coarsest precision asked
for, so every precision's reference sees the same values and `out_f64` is the answer for the
stored inputs themselves, not for values the rounding already moved.
"""

import json
import re
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from codegen.kit.vector_cases import make_case
from codegen.kit.vector_options import (
    OPTIONS,
    resolve,
)
from weights.writer import atomic_write, write_safetensors

# Precision name → (tensor suffix, numpy dtype, machine epsilon).
PRECISIONS = {
    "float64": ("f64", np.dtype(np.float64), 2.0**-52),
    "float32": ("f32", np.dtype(np.float32), 2.0**-23),
    "float16": ("f16", np.dtype(np.float16), 2.0**-10),
    "bfloat16": ("bf16", np.dtype(ml_dtypes.bfloat16), 2.0**-7),
}
# The smallest normal float16: a bfloat16 value at or above it is exact in float16 too.
_F16_TINY = 2.0**-14


def round_to(x, low):
    """float64 values → the same values on the grid of float32 and every precision in `low`
    (with both float16 and bfloat16: bfloat16 values, those below float16's normal range
    flushed to 0, so each is exact in both) → float64 array."""
    x = np.asarray(x, np.float32).astype(np.float64)
    if "bfloat16" in low:
        x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
        if "float16" in low:
            x = np.where(np.abs(x) < _F16_TINY, 0.0, x)
    elif "float16" in low:
        x = x.astype(np.float16).astype(np.float64)
    return x


def _round_scalar(value, low):
    return None if value is None else float(round_to(np.float64(value), low))


def _run(case, precision, floats, scalars):
    """ref on the inputs cast to `precision` → numpy output (ref's output dtype).

    One jit per call: one XLA compile instead of one per distinct primitive and shape (ref's
    blocked modes unroll into hundreds); measured 1.4× faster on tests/codegen/kit/test_vectors.py.
    """
    dtype = PRECISIONS[precision][1]
    with jax.enable_x64(True):
        arrays = {k: jnp.asarray(v.astype(dtype)) for k, v in floats.items()}
        arrays |= {k: jnp.asarray(v) for k, v in case.ints.items()}
        return np.asarray(jax.jit(lambda a: case.run(a, scalars))(arrays))


def _info(array, layout):
    return {"shape": list(array.shape), "dtype": str(array.dtype), "layout": layout}


def command(op, mode, options, seed, low, out):
    """The CLI line that regenerates these vectors, every option spelled out."""
    words = ["python", "-m", "codegen", "vectors", "--op", op]
    if mode is not None:
        words += ["--mode", mode]
    for name, value in options.items():
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        words += ["--opt", f"{name}={text}"]
    words += ["--out", str(out), "--seed", str(seed)]
    words += [{"float16": "--fp16", "bfloat16": "--bf16"}[p] for p in low]
    return shlex.join(words)


def _tolerance(outputs, precisions):
    exact = np.asarray(outputs["out_f64"], np.float64)
    top = max(1.0, float(np.abs(exact).max(initial=0.0)))
    rule = {
        "rule": "a kernel computing in precision X passes when max|out - out_f64| <= "
        "2 * X.ref_error + X.floor (FlashAttention's rule: at most twice ref's own error in "
        "that precision, plus an absolute floor); X.bound is that right-hand side",
        "ref_error": "max|out_X - out_f64|: ref itself run in precision X on the same inputs",
        "floor": "eps(X) * max(1, max|out_f64|), eps: float32 2^-23, float16 2^-10, bfloat16 2^-7",
    }
    for precision in precisions:
        suffix, _, eps = PRECISIONS[precision]
        got = np.asarray(outputs[f"out_{suffix}"], np.float64)
        error = float(np.abs(got - exact).max(initial=0.0))
        floor = eps * top
        rule[precision] = {"ref_error": error, "floor": floor, "bound": 2 * error + floor}
    return rule


def generate(op, mode=None, given=None, *, seed=0, low=(), out="DIR"):
    """The vectors of one op: (tensors {name: numpy array}, description dict for the JSON).

    given: {option: text} as from `--opt`; low: a subset of ("float16", "bfloat16") to add;
    out: the folder named in the regenerating command.
    """
    for p in low:
        if p not in ("float16", "bfloat16"):
            raise ValueError(f"low precision {p!r}: expected float16 or bfloat16")
    low = tuple(p for p in ("float16", "bfloat16") if p in low)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed {seed!r}: expected an integer >= 0")
    mode, options = resolve(op, mode, given)
    for name, value in options.items():
        if OPTIONS[op][name].kind == "float" and value is not None:
            options[name] = _round_scalar(value, low)
    case = make_case(op, mode, options, np.random.default_rng(seed))
    floats = {k: round_to(v, low) for k, v in case.floats.items()}
    scalars = {k: _round_scalar(v, low) for k, v in case.scalars.items()}
    precisions = ("float64", "float32", *low)
    outputs = {f"out_{PRECISIONS[p][0]}": _run(case, p, floats, scalars) for p in precisions}
    tensors = {k: v.astype(np.float32) for k, v in floats.items()}
    tensors |= {k: np.asarray(v, np.int32) for k, v in case.ints.items()}
    layouts = dict(case.layouts)
    for p in low:
        suffix, dtype, _ = PRECISIONS[p]
        for k, v in floats.items():
            tensors[f"{k}_{suffix}"] = v.astype(dtype)
            layouts[f"{k}_{suffix}"] = f"{case.layouts[k]}, the same values as {k}"
    meta = {
        "op": op,
        "mode": mode,
        "seed": seed,
        "options": options,
        "scalars": scalars,
        "reference": case.reference,
        "inputs": {k: _info(tensors[k], layouts[k]) for k in layouts},
        "outputs": {
            k: _info(v, f"{case.out_layout}; ref run in {p}")
            for (k, v), p in zip(outputs.items(), precisions, strict=True)
        },
        "tolerance": _tolerance(outputs, precisions[1:]),
        "inputs_note": "float inputs: standard normal (numpy default_rng(seed)) rounded to "
        f"{' and '.join(('float32', *low))}, so every copy holds the same values",
        **case.extra,
        "command": command(op, mode, options, seed, low, out),
    }
    return tensors | outputs, meta


def write(out, op, mode=None, given=None, *, seed=0, low=()):
    """Write out/vectors.safetensors and out/vectors.json (each atomically); returns meta."""
    out = Path(out)
    tensors, meta = generate(op, mode, given, seed=seed, low=low, out=out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "vectors.safetensors", tensors)
    text = _compact_lists(json.dumps(meta, indent=2)) + "\n"
    atomic_write(out / "vectors.json", [text.encode("utf-8")])
    return meta


def _compact_lists(text):
    """Lists of numbers on one line (shapes, block bounds), as a person reads them."""
    return re.sub(r"\[([-\d.,e\s]*)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def summary(meta):
    """Lines the CLI prints: what was written and the tolerance bound per precision."""
    lines = [f"{meta['op']} {meta['mode'] or ''}".rstrip()]
    for name, info in {**meta["inputs"], **meta["outputs"]}.items():
        lines.append(f"  {name:14s} {info['dtype']:9s} {str(tuple(info['shape'])):22s}")
    for precision in ("float32", "float16", "bfloat16"):
        t = meta["tolerance"].get(precision)
        if t:
            lines.append(
                f"  {precision}: ref error {t['ref_error']:.3g}, floor {t['floor']:.3g}, "
                f"bound {t['bound']:.3g}"
            )
    return "\n".join(lines)
