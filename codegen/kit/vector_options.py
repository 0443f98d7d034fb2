"""The options of each golden-vector op (`python -m codegen vectors --op OP --opt k=v`): their
declaration (default, kind, help), parsing and resolution against a blocking mode's defaults,
and the attention problem (sizes, positions, mask) the resolved options describe."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from ref import cache, moe_modes
from ref.attention import mask
from ref.blocking import MODES, BlockingConfig
from ref.blocking import mode as blocking_mode
from ref.gemma4.audio_config import AudioConfig
from ref.gemma4.audio_packing import pack

OPS = ("attention", "cache_update", "vision_attention", "audio_attention", "pool", "rope2d", "moe")
ATTENTION_MODES = ("dense", *MODES)
# The kit's one mode table: the ops that take --mode, their modes (the first is the default).
# attention: ref.blocking's modes; moe: ref.moe_modes' (how QEfficient runs the experts).
OP_MODES = {"attention": ATTENTION_MODES, "moe": moe_modes.NAMES}
# The nsp mode's counts at the kit's small default sizes (4 experts over 8 tokens: 2 cores of
# 2 slots, 2 chunks); QEfficient compiles ref.moe_modes.NSP_DEFAULTS (16 cores, 256 rows).
NSP_KIT_DEFAULTS = {"num_nsp": 2, "packed_chunk": 4}
# The ops `plan` draws: the moded ones and the audio tower's chunked attention.
PLAN_OPS = (*OP_MODES, "audio_attention")
# The released audio chunking (12 queries, 12 past keys, cap 50): audio_attention's defaults.
_AUDIO = AudioConfig()


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
NSP_OPTIONS = {
    "num_nsp": Option(None, "int", "nsp: cores the experts split over (expert s*num_nsp + c is "
                      "core c's slot s)", True),
    "packed_chunk": Option(None, "int", "nsp: rows of each chunk of an expert's packed tokens",
                           True),
}  # fmt: skip
# Options set only by some modes: given for another mode they are refused by name.
_MODE_OPTIONS = {**BLOCKING_OPTIONS, **NSP_OPTIONS}
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
    "audio_attention": {
        "clips": Option(
            "120,64,80",
            "counts",
            "valid log-mel frames of each packed clip (soft tokens: ceil(ceil(n/2)/2) each)",
        ),
        "frame_budget": Option(
            None,
            "int",
            "N frames the call is sized for (filler tokens and chunks after the clips, "
            "ref.gemma4.audio_packing.budgets); none: the clips' exact sizes",
            True,
        ),
        "max_clips": Option(None, "int", "clips a frame budget has room for (none: given)", True),
        **_sizes(heads=2, head_dim=8),
        "chunk": Option(_AUDIO.attention_chunk_size, "int", "C, queries per chunk"),
        "context_left": Option(
            _AUDIO.attention_context_left, "int", "P + 1: a query sees itself and P - 1 past keys"
        ),
        "context_right": Option(_AUDIO.attention_context_right, "int", "F, future keys per chunk"),
        "cap": Option(_AUDIO.attention_logit_cap, "float", "logit soft cap c*tanh(s/c), then mask"),
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
    "moe": {
        "tokens": Option(8, "int", "T, token rows of the step (batch x seq_len)"),
        "hidden": Option(8, "int", "D, hidden size"),
        "experts": Option(4, "int", "E, experts"),
        "intermediate": Option(4, "int", "I, each expert's intermediate size"),
        "top_k": Option(2, "int", "K, experts per token"),
        "hot": Option(
            0, "int", "the first `hot` tokens all pick expert 0 first (a crowded expert)"
        ),
        **NSP_OPTIONS,
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
        if option.kind == "counts":
            values = counts(low)
            if min(values) < 0:
                raise ValueError
            return ",".join(map(str, values))
        grids = tuple(_grid(g) for g in low.split(",") if g)
        if not grids:
            raise ValueError
        return ",".join(f"{h}x{w}" for h, w in grids)
    except ValueError:
        expected = {"bool": "true or false", "int": "an integer", "float": "a finite number"}
        expected["counts"] = "comma-separated integers >= 0 such as 120,64,80"
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


def counts(text):
    """'120,64,80' → (120, 64, 80)."""
    return tuple(int(c) for c in text.split(","))


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
    """Every option of `op` with its value: defaults, the mode's counts (attention:
    `ref.blocking.TABLE`; moe nsp: NSP_KIT_DEFAULTS), then `given` ({name: text}). Returns
    (mode, options) with options in declared order; a mode's own options only where it uses
    them. ValueError names any unknown op, mode or option, or a value of the wrong kind."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {', '.join(OPS)}")
    if op in OP_MODES:
        modes = OP_MODES[op]
        mode = modes[0] if mode is None else mode
        if mode not in modes:
            raise ValueError(f"unknown {op} mode {mode!r}; expected one of {', '.join(modes)}")
    elif mode is not None:
        ops = " or ".join(f"--op {o}" for o in OP_MODES)
        raise ValueError(f"--mode {mode!r} is only for {ops}, not --op {op}")
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
        if name in _MODE_OPTIONS:
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
    if op == "moe":
        counts = {k: v for k, v in parsed.items() if k in NSP_OPTIONS and v is not None}
        if mode != "nsp" and counts:
            name, value = next(iter(counts.items()))
            raise ValueError(f"option {name}={value} is not used by mode {mode!r} (nsp only)")
        if mode == "nsp":
            options |= {**NSP_KIT_DEFAULTS, **counts}
        moe_mode(mode, options).check(options["experts"], moe_sizes(options)[0])
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


def audio_packing(options):
    """The AudioConfig and the packing (`ref.gemma4.audio_packing.pack`) of resolved
    audio_attention options → (config, packing); ValueError naming a bad size, chunking (by its
    AudioConfig field) or budget."""
    h, d = options["heads"], options["head_dim"]
    if min(h, d) < 1:
        raise ValueError(f"heads={h}, head_dim={d}: expected sizes >= 1")
    config = AudioConfig(
        hidden_size=h * d,
        num_attention_heads=h,
        attention_chunk_size=options["chunk"],
        attention_context_left=options["context_left"],
        attention_context_right=options["context_right"],
        attention_logit_cap=options["cap"],
    )
    frames = counts(options["clips"])
    packing = pack(
        frames, config, frame_budget=options["frame_budget"], max_clips=options["max_clips"]
    )
    if not packing.num_real_tokens:
        raise ValueError(
            f"clips={options['clips']} give no soft token: expected a clip of at least 1 frame"
        )
    return config, packing


def moe_mode(mode, options):
    """The `ref.moe_modes.MoeMode` of a moe mode name and its resolved options."""
    counts = {k: options[k] for k in NSP_OPTIONS if k in options}
    return moe_modes.MoeMode(mode, **counts)


def moe_sizes(options):
    """(T, D, E, I, K) from resolved moe options, checked: sizes ≥ 1, K ≤ E, hot ≤ T."""
    names = ("tokens", "hidden", "experts", "intermediate", "top_k")
    sizes = tuple(options[n] for n in names)
    for name, value in zip(names, sizes, strict=True):
        if value < 1:
            raise ValueError(f"option {name}={value}: expected an integer >= 1")
    if sizes[4] > sizes[2]:
        raise ValueError(f"top_k={sizes[4]} is more than the experts={sizes[2]}")
    if options["hot"] > sizes[0]:
        raise ValueError(f"hot={options['hot']} is more than the tokens={sizes[0]}")
    return sizes


def moe_routing(options, rng):
    """A router's output for resolved moe options → (weights [T, K] float64, index [T, K]
    int32): standard normal logits [T, E] (the first `hot` tokens' expert 0 raised above
    their others), each token's top-k (the lower expert first among ties, as `lax.top_k`)
    and the softmax over those k logits (what `ref.gemma4.moe.route` gives with
    per_expert_scale 1)."""
    t, _, e, _, k = moe_sizes(options)
    logits = rng.standard_normal((t, e))
    hot = options["hot"]
    logits[:hot, 0] = logits[:hot].max(axis=1) + 1.0
    index = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, index, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True), index.astype(np.int32)
