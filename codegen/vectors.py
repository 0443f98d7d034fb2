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

import dataclasses
import json
import math
import re
import shlex
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ref import cache
from ref.attention import blocked, mask, reference
from ref.blocking import MODES, BlockingConfig
from ref.blocking import mode as blocking_mode
from ref.gemma4.packing import pack
from ref.gemma4.vision import packed_attention, pool
from ref.rope import axial_rope
from weights.safetensors import atomic_write, write_safetensors

OPS = ("attention", "cache_update", "vision_attention", "pool", "rope2d")
ATTENTION_MODES = ("dense", *MODES)

# Precision name → (tensor suffix, numpy dtype, machine epsilon).
PRECISIONS = {
    "float64": ("f64", np.dtype(np.float64), 2.0**-52),
    "float32": ("f32", np.dtype(np.float32), 2.0**-23),
    "float16": ("f16", np.dtype(np.float16), 2.0**-10),
    "bfloat16": ("bf16", np.dtype(ml_dtypes.bfloat16), 2.0**-7),
}
# The smallest normal float16: a bfloat16 value at or above it is exact in float16 too.
_F16_TINY = 2.0**-14


@dataclasses.dataclass(frozen=True)
class Option:
    """One `--opt` of an op: its default, its kind (int, float, bool, grids) and what it sets;
    optional ones also take `none`."""

    default: object
    kind: str
    help: str
    optional: bool = False


def _sizes(**defaults):
    helps = {
        "batch": "B, batch rows",
        "heads": "H, query heads",
        "kv_heads": "Hkv, kv heads (kv head j serves query heads j*g .. j*g+g-1)",
        "seq": "S, queries of the call",
        "ctx": "T, cache slots",
        "head_dim": "D, channels per head",
    }
    return {name: Option(value, "int", helps[name]) for name, value in defaults.items()}


def _blocking_options():
    """Every `BlockingConfig` field but mode, as options (the config is their one home)."""
    out = {}
    for field in dataclasses.fields(BlockingConfig):
        if field.name == "mode":
            continue
        kind = "bool" if isinstance(field.default, bool) else "int"
        out[field.name] = Option(None, kind, "ref.blocking.BlockingConfig", kind == "int")
    return out


BLOCKING_OPTIONS = _blocking_options()
_GRIDS_HELP = "items' (h, w) patch grids, e.g. 3x3,3x6"

OPTIONS = {
    "attention": {
        **_sizes(batch=2, heads=4, kv_heads=2, seq=8, ctx=16, head_dim=8),
        "q_start": Option(
            None,
            "int",
            "row 0's first query position (default ctx - seq); row b starts b earlier, "
            "positions below 0 are padding (-1); the cache is linear (slot t = position t)",
            True,
        ),
        "sliding_window": Option(None, "int", "W: keys with q_pos - kv_pos < W", True),
        "softcap": Option(None, "float", "c: scores become c*tanh(s/c)", True),
        "scale": Option(1.0, "float", "score scale (Gemma 4: 1.0)"),
        "vision": Option(0, "int", "length of one vision run in each row's chunk (0: none)"),
        "vision_offset": Option(1, "int", "first query of the vision run"),
        **BLOCKING_OPTIONS,
    },
    "cache_update": {
        **_sizes(batch=2, kv_heads=2, seq=4, ctx=16, head_dim=8),
        "empty": Option(1, "int", "slots per row set to -1 (write nothing)"),
    },
    "vision_attention": {
        "grids": Option("3x3,3x6", "grids", _GRIDS_HELP + ", sides multiples of 3"),
        "budget": Option(4, "int", "soft-token budget: pad to budget*9 patches (filler)", True),
        **_sizes(heads=4, kv_heads=2, head_dim=8),
        "varlen": Option(False, "bool", "ref computes per item over cu_seqlens, not by mask"),
    },
    "pool": {
        "grids": Option("3x6,6x3", "grids", _GRIDS_HELP + ", sides multiples of 3"),
        "budget": Option(None, "int", "soft-token budget (filler tokens pool the filler)", True),
        "hidden": Option(8, "int", "D, channels"),
        "scale": Option(None, "float", "output scale (default sqrt(hidden), as the tower)", True),
    },
    "rope2d": {
        "grids": Option("3x6", "grids", _GRIDS_HELP + " (positions x = column, y = row)"),
        **_sizes(heads=2, head_dim=8),
        "theta": Option(100.0, "float", "RoPE base (Gemma 4 vision: 100)"),
    },
}


def _parse_value(name, option, text):
    """`text` as the option's kind; ValueError naming the option and the value."""
    low = text.strip().lower()
    if option.optional and low == "none":
        return None
    try:
        if option.kind == "bool":
            if low not in ("true", "false", "1", "0"):
                raise ValueError
            return low in ("true", "1")
        if option.kind == "int":
            return int(low)
        if option.kind == "float":
            value = float(low)
            if not math.isfinite(value):
                raise ValueError
            return value
        grids = tuple(_grid(g) for g in low.split(",") if g)
        if not grids:
            raise ValueError
        return ",".join(f"{h}x{w}" for h, w in grids)
    except ValueError:
        expected = {"bool": "true or false", "int": "an integer", "float": "a finite number"}
        want = expected.get(option.kind, "HxW grids such as 3x3,3x6")
        none = " or none" if option.optional else ""
        raise ValueError(f"option {name}={text!r}: expected {want}{none}") from None


def _grid(text):
    h, x, w = text.partition("x")
    if not (x and h.isdigit() and w.isdigit()):
        raise ValueError(text)
    return int(h), int(w)


def grids(text):
    """'3x3,3x6' → ((3, 3), (3, 6))."""
    return tuple(_grid(g) for g in text.split(","))


def parse_pairs(pairs):
    """['k=v', ...] → {k: 'v'}; ValueError on a pair without '=' or a key given twice."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--opt {pair!r}: expected key=value")
        if key in out:
            raise ValueError(f"--opt {key} given twice ({out[key]!r} and {value!r})")
        out[key] = value
    return out


def resolve(op, mode=None, given=None):
    """Every option of `op` with its value: defaults, the mode's block counts (attention:
    `ref.blocking.TABLE`), then `given` ({name: text}). Returns (mode, options)
    with options in declared order; blocking options only where set. ValueError names any
    unknown op, mode or option, or a value of the wrong kind."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    if op == "attention":
        mode = "dense" if mode is None else mode
        if mode not in ATTENTION_MODES:
            raise ValueError(
                f"unknown attention mode {mode!r}; expected one of {', '.join(ATTENTION_MODES)}"
            )
    elif mode is not None:
        raise ValueError(f"--mode {mode!r} is only for --op attention, not --op {op}")
    known = OPTIONS[op]
    given = dict(given or {})
    for name in given:
        if name not in known:
            raise ValueError(
                f"unknown option {name!r} for --op {op}; expected one of {', '.join(known)}"
            )
    parsed = {name: _parse_value(name, known[name], text) for name, text in given.items()}
    options = {}
    for name, option in known.items():
        if name in BLOCKING_OPTIONS:
            continue
        options[name] = parsed.get(name, option.default)
        if option.kind == "int" and options[name] is not None and options[name] < 0:
            raise ValueError(f"option {name}={options[name]}: expected an integer >= 0")
    if op == "attention":
        blocking = {k: v for k, v in parsed.items() if k in BLOCKING_OPTIONS}
        if mode == "dense" and blocking:
            name, value = next(iter(blocking.items()))
            raise ValueError(f"option {name}={value} is not used by mode 'dense' (no blocks)")
        if mode != "dense":
            options |= {**blocking_mode(mode).defaults, **blocking}
    return mode, options


def blocking_config(mode, options):
    """The `BlockingConfig` of an attention mode and its resolved options (None for dense)."""
    if mode == "dense":
        return None
    return BlockingConfig(mode=mode, **{k: v for k, v in options.items() if k in BLOCKING_OPTIONS})


def attention_sizes(options):
    """(B, H, Hkv, S, T, D) from resolved attention options, checked to be ≥ 1 and GQA."""
    names = ("batch", "heads", "kv_heads", "seq", "ctx", "head_dim")
    sizes = tuple(options[n] for n in names)
    for name, value in zip(names, sizes, strict=True):
        if value < 1:
            raise ValueError(f"option {name}={value}: expected an integer >= 1")
    if sizes[1] % sizes[2]:
        raise ValueError(f"heads={sizes[1]} must be a multiple of kv_heads={sizes[2]}")
    return sizes


def attention_positions(options):
    """Positions of a chunk in a linear cache → q_pos, q_group [B, S], kv_pos, kv_group [B, T]
    int32 (groups None without a vision run).

    Row b's queries sit at q_start − b + s (below 0: padding, −1); slot t holds position t,
    filled up to the row's last query (`ref.cache.causal_positions`). A vision run (id 0) covers
    queries vision_offset … vision_offset + vision − 1 and the slots of their positions.
    """
    b, _, _, s, t, _ = attention_sizes(options)
    start = t - s if options["q_start"] is None else options["q_start"]
    if start + s > t:
        raise ValueError(
            f"q_start={start} with seq={s} runs past the cache of ctx={t} slots: "
            f"expected q_start <= {t - s}"
        )
    q_pos = start - np.arange(b)[:, None] + np.arange(s)
    q_pos = np.where(q_pos >= 0, q_pos, -1).astype(np.int32)
    kv_pos = np.asarray(cache.causal_positions(jnp.asarray(q_pos), t), np.int32)
    n, offset = options["vision"], options["vision_offset"]
    if not n:
        return q_pos, kv_pos, None, None
    if offset + n > s:
        raise ValueError(
            f"vision={n} at vision_offset={offset} does not fit the {s} queries: a run must "
            "lie inside one chunk"
        )
    q_group = np.full((b, s), -1, np.int32)
    q_group[:, offset : offset + n] = np.where(q_pos[:, offset : offset + n] >= 0, 0, -1)
    run = np.where(q_group == 0, q_pos, -2)
    kv_group = np.where((kv_pos[:, :, None] == run[:, None, :]).any(-1), 0, -1).astype(np.int32)
    return q_pos, kv_pos, q_group, kv_group


def attention_mask(options):
    """ref's mask for these options → visible [B, S, T] bool (numpy)."""
    q_pos, kv_pos, q_group, kv_group = attention_positions(options)
    m = mask(
        q_pos,
        kv_pos,
        sliding_window=options["sliding_window"],
        q_group=q_group,
        kv_group=kv_group,
    )
    return np.asarray(m)[:, 0]


@dataclasses.dataclass(frozen=True)
class Case:
    """One op's vectors before rounding: float inputs (float64 values) and int inputs, each
    with its layout; `run(arrays)` is ref on jnp arrays; `scalars` are float options that enter
    the arithmetic (rounded with the inputs); `extra` goes into vectors.json as is."""

    floats: dict
    ints: dict
    layouts: dict
    out_layout: str
    reference: str
    run: object
    scalars: dict
    extra: dict


def _attention_case(mode, options, rng):
    b, h, hkv, s, t, d = attention_sizes(options)
    config = blocking_config(mode, options)
    plan = None
    if config is not None:
        plan = config.plan(b, h, hkv, s, t, num_devices=jax.local_device_count())
    q_pos, kv_pos, q_group, kv_group = attention_positions(options)
    fold = config is not None and config.batch_fold
    cache_shape = (1, b * hkv, t, d) if fold else (b, hkv, t, d)
    cache_layout = "[1, B*Hkv, T, D] (batch_fold: row b*Hkv + j)" if fold else "[B, Hkv, T, D]"
    floats = {
        "q": rng.standard_normal((b, h, s, d)),
        "k": rng.standard_normal((b, hkv, t, d)).reshape(cache_shape),
        "v": rng.standard_normal((b, hkv, t, d)).reshape(cache_shape),
    }
    ints = {"q_pos": q_pos, "kv_pos": kv_pos}
    layouts = {
        "q": "[B, H, S, D]",
        "k": cache_layout,
        "v": cache_layout,
        "q_pos": "[B, S] (-1 = padding)",
        "kv_pos": "[B, T] (-1 = empty slot)",
    }
    if q_group is not None:
        ints |= {"q_group": q_group, "kv_group": kv_group}
        layouts |= {"q_group": "[B, S] (vision run id, -1 = text)", "kv_group": "[B, T]"}
    window = options["sliding_window"]

    def run(a, scalars):
        kwargs = dict(
            sliding_window=window,
            q_group=a.get("q_group"),
            kv_group=a.get("kv_group"),
            scale=scalars["scale"],
            softcap=scalars["softcap"],
        )
        args = (a["q"], a["k"], a["v"], a["q_pos"], a["kv_pos"])
        if config is None:
            return reference(*args, **kwargs)
        return blocked(*args, config=config, **kwargs)

    groups = "q_group=q_group, kv_group=kv_group, " if q_group is not None else ""
    call = "reference" if config is None else "blocked"
    how = "" if config is None else f", config={config!r}"
    return Case(
        floats=floats,
        ints=ints,
        layouts=layouts,
        out_layout="[B, H, S, D]",
        reference=f"ref.attention.{call}(q, k, v, q_pos, kv_pos, {groups}"
        f"sliding_window={window}, scale=scale, softcap=softcap{how})",
        run=run,
        scalars={"scale": options["scale"], "softcap": options["softcap"]},
        extra={"blocks": None if plan is None else _plain(dataclasses.asdict(plan))},
    )


def _plain(x):
    """Tuples → lists, recursively (for JSON)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def _cache_update_case(options, rng):
    b, hkv, s, t, d = (options[n] for n in ("batch", "kv_heads", "seq", "ctx", "head_dim"))
    for name in ("batch", "kv_heads", "seq", "ctx", "head_dim"):
        if options[name] < 1:
            raise ValueError(f"option {name}={options[name]}: expected an integer >= 1")
    if s > t:
        raise ValueError(f"seq={s} distinct slots do not fit the cache of ctx={t} slots")
    if options["empty"] > s:
        raise ValueError(f"empty={options['empty']} is more than the seq={s} slots per row")
    slots = np.stack([rng.permutation(t)[:s] for _ in range(b)])
    for row in slots:
        row[rng.permutation(s)[: options["empty"]]] = -1
    floats = {
        "cache_k": rng.standard_normal((b, hkv, t, d)),
        "cache_v": rng.standard_normal((b, hkv, t, d)),
        "k_new": rng.standard_normal((b, hkv, s, d)),
        "v_new": rng.standard_normal((b, hkv, s, d)),
    }

    def run(a, _):
        new = cache.update(a["cache_k"], a["cache_v"], a["k_new"], a["v_new"], a["slots"])
        return jnp.stack(new)

    return Case(
        floats=floats,
        ints={"slots": slots.astype(np.int32)},
        layouts={
            "cache_k": "[B, Hkv, T, D]",
            "cache_v": "[B, Hkv, T, D]",
            "k_new": "[B, Hkv, S, D]",
            "v_new": "[B, Hkv, S, D]",
            "slots": "[B, S] (-1 = write nothing; distinct otherwise)",
        },
        out_layout="[2, B, Hkv, T, D] (the updated cache_k, then cache_v)",
        reference="jnp.stack(ref.cache.update(cache_k, cache_v, k_new, v_new, slots))",
        run=run,
        scalars={},
        extra={},
    )


def _heads(options):
    h, hkv, d = options["heads"], options["kv_heads"], options["head_dim"]
    if min(h, hkv, d) < 1 or h % hkv:
        raise ValueError(
            f"heads={h}, kv_heads={hkv}, head_dim={d}: expected sizes >= 1 with heads a "
            "multiple of kv_heads"
        )
    return h, hkv, d


def _vision_attention_case(options, rng):
    h, hkv, d = _heads(options)
    packing = pack(grids(options["grids"]), budget=options["budget"])
    n = len(packing.segment_ids)
    cu = packing.cu_seqlens_static if options["varlen"] else None

    def run(a, _):
        return packed_attention(a["q"], a["k"], a["v"], a["segment_ids"], cu)

    return Case(
        floats={
            "q": rng.standard_normal((n, h, d)),
            "k": rng.standard_normal((n, hkv, d)),
            "v": rng.standard_normal((n, hkv, d)),
        },
        ints={"segment_ids": packing.segment_ids, "cu_seqlens": packing.cu_seqlens},
        layouts={
            "q": "[N, H, D] (packed patches)",
            "k": "[N, Hkv, D]",
            "v": "[N, Hkv, D]",
            "segment_ids": "[N] item index, -1 = filler (attends to nothing, output 0)",
            "cu_seqlens": "[items + 1] patch offsets of the items (filler after the last)",
        },
        out_layout="[N, H, D]",
        reference="ref.gemma4.vision.packed_attention(q, k, v, segment_ids"
        + (", cu_seqlens=tuple(cu_seqlens))" if cu else ")"),
        run=run,
        scalars={},
        extra={"grids": [list(g) for g in packing.grids]},
    )


def _pool_case(options, rng):
    if options["hidden"] < 1:
        raise ValueError(f"option hidden={options['hidden']}: expected an integer >= 1")
    packing = pack(grids(options["grids"]), budget=options["budget"])
    scale = options["scale"]
    scale = math.sqrt(options["hidden"]) if scale is None else scale

    def run(a, scalars):
        return pool(a["x"], a["pool_index"], scalars["scale"])

    return Case(
        floats={"x": rng.standard_normal((len(packing.segment_ids), options["hidden"]))},
        ints={"pool_index": packing.pool_index},
        layouts={
            "x": "[N, D] (packed patches)",
            "pool_index": "[M, 9] indices into x of each soft token's 3x3 block",
        },
        out_layout="[M, D], float32 for float16/bfloat16 x (ref pools in at least float32)",
        reference="ref.gemma4.vision.pool(x, pool_index, scale)",
        run=run,
        scalars={"scale": scale},
        extra={"grids": [list(g) for g in packing.grids]},
    )


def _rope2d_case(options, rng):
    h, _, d = _heads({**options, "kv_heads": 1})
    positions = pack(grids(options["grids"]), pooling_kernel_size=1).positions

    def run(a, scalars):
        return axial_rope(a["x"], a["positions"], scalars["theta"])

    return Case(
        floats={"x": rng.standard_normal((len(positions), h, d))},
        ints={"positions": positions},
        layouts={"x": "[N, H, D]", "positions": "[N, 2] (x = column, y = row), per item"},
        out_layout="[N, H, D]",
        reference="ref.rope.axial_rope(x, positions, theta)",
        run=run,
        scalars={"theta": options["theta"]},
        extra={"note": "ref computes angles, cos and sin in float32 for every input dtype"},
    )


def _case(op, mode, options, rng):
    if op == "attention":
        return _attention_case(mode, options, rng)
    builders = {
        "cache_update": _cache_update_case,
        "vision_attention": _vision_attention_case,
        "pool": _pool_case,
        "rope2d": _rope2d_case,
    }
    return builders[op](options, rng)


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
    blocked modes unroll into hundreds); measured 1.4× faster on tests/test_vectors.py.
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
    case = _case(op, mode, options, np.random.default_rng(seed))
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
        "command": command(op, None if op != "attention" else mode, options, seed, low, out),
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
