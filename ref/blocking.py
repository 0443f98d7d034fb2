"""Blocking options for `ref.attention.blocked`, named as QEfficient's `qaic_config` names them:
the table of modes (`TABLE`), the names that resolve to them, and `BlockingConfig`.

A `BlockingConfig` is checked twice: on construction (mode known, counts positive, no option the
mode ignores) and by `plan` against the array shapes (no more blocks than tokens, head blocks
that fit the GQA groups). `plan` turns it into the static block boundaries the unrolled loops use
(`ref.blocking_plan.Plan`).
"""

import dataclasses

from ref.blocking_plan import Plan, head_blocks, ranges


@dataclasses.dataclass(frozen=True)
class Mode:
    """One row of the table of blocking modes (`TABLE`), the one home of a mode's facts.

    axes: the block axes it cuts, outermost first — b(atch), h(eads), q(ueries), kv, r (GQA
    n_rep chunks); kv: how KV blocks combine — "dense" (one pass over the cache), "online"
    (the sequential recurrence) or "merged" (independent states merged once); defaults: the
    options a name alone gets (two blocks along each cut axis, one query head per head block);
    math: its one line; phase: "prefill" for QEfficient's prefill modes, else "any".
    """

    name: str
    axes: tuple
    kv: str
    defaults: dict
    math: str
    phase: str = "any"

    @property
    def options(self):
        """The block-count option of each cut axis, in axis order."""
        return tuple(_count_option(self.name, axis) for axis in self.axes)


_KV2, _Q2, _H1 = {"num_kv_blocks": 2}, {"num_q_blocks": 2}, {"head_block_size": 1}
_CHUNKS2 = {"prefill_block_chunks": 2}
TABLE = (
    Mode("kv", ("kv",), "online", _KV2, "online over KV blocks, all queries at once"),
    Mode("q", ("q",), "dense", _Q2, "per query block, dense over the cache"),
    Mode("h", ("h",), "dense", _H1, "per head block, dense over the cache"),
    Mode("qkv", ("q", "kv"), "online", _Q2 | _KV2, "per query block, online over KV blocks"),
    Mode("hq", ("h", "q"), "dense", _H1 | _Q2, "per head × query block, dense over the cache"),
    Mode("hkv", ("h", "kv"), "online", _H1 | _KV2, "per head block, online over KV blocks"),
    Mode(
        "hqkv",
        ("h", "q", "kv"),
        "online",
        _H1 | _Q2 | _KV2,
        "per head × query block, online over KV blocks",
    ),
    Mode(
        "bhqkv",
        ("b", "h", "q", "kv"),
        "online",
        {"num_batch_blocks": 2} | _H1 | _Q2 | _KV2,
        "per batch × head × query block, online over KV blocks",
    ),
    Mode(
        "prefill_q",
        ("q", "r"),
        "dense",
        _CHUNKS2,
        "per query chunk × n_rep chunk, dense over the cache",
        "prefill",
    ),
    Mode(
        "prefill_kv",
        ("kv", "r"),
        "online",
        _KV2,
        "per n_rep chunk, online over KV blocks",
        "prefill",
    ),
    Mode(
        "prefill_qkv",
        ("q", "kv", "r"),
        "merged",
        _CHUNKS2 | _KV2,
        "per query chunk × n_rep chunk, per-KV-block states merged once",
        "prefill",
    ),
    Mode(
        "prefill_online",
        ("q", "kv", "r"),
        "online",
        _CHUNKS2 | _KV2,
        "per query chunk × n_rep chunk, online over KV blocks",
        "prefill",
    ),
)
_BY_NAME = {m.name: m for m in TABLE}
# Names used elsewhere for a mode with fixed options: QEfficient's and the export CLI's.
ALIASES = {
    "kv_headpar": ("kv", {"headpar_split": 2}),
    "kv_batch_fold": ("kv", {"batch_fold": True}),
}
# A prefill phase reads these short names (QEfficient's `prefill_blocking_mode`,
# `Gemma4.generate`'s prefill_blocking) as the prefill modes.
PREFILL_NAMES = {
    "q": "prefill_q",
    "kv": "prefill_kv",
    "qkv": "prefill_qkv",
    "online": "prefill_online",
}
DENSE_NAMES = ("none", "dense")
# (query tiles, KV tiles) of the packed vision attention in an exported vision graph
# (`ref.gemma4.vision.tiled_packed_attention`); chosen by benchmarks/vision_tiled_memory.py
# (docs/codegen.md).
VISION_TILES = (3, 3)

_AXES = {m.name: " ".join(m.axes) for m in TABLE}
MODES = tuple(_AXES)


def mode(name):
    """The table row of a mode name (no alias)."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown blocking mode {name!r}; expected one of {MODES}")
    return _BY_NAME[name]


def resolve(name, *, prefill=False):
    """(mode name, options it implies) for any name used for a blocking mode — a table row,
    an alias (`kv_headpar`, `kv_batch_fold`), a prefill short name when `prefill` (`q`, `kv`,
    `qkv`, `online`) — or None for dense (`none`, `dense`, None)."""
    if name is None or name in DENSE_NAMES:
        return None
    if prefill and name in PREFILL_NAMES:
        return PREFILL_NAMES[name], {}
    if name in ALIASES:
        base, options = ALIASES[name]
        return base, dict(options)
    return mode(name).name, {}


def names(*, prefill=False):
    """Every name `resolve` takes in a phase (dense names first)."""
    short = tuple(PREFILL_NAMES) if prefill else ()
    return DENSE_NAMES + tuple(dict.fromkeys(short + MODES + tuple(ALIASES)))


def default_options(name, *, prefill=False):
    """(mode name, options) a name alone asks for: the row's defaults and the alias's options
    (None for dense)."""
    resolved = resolve(name, prefill=prefill)
    if resolved is None:
        return None
    base, options = resolved
    return base, {**mode(base).defaults, **options}


def for_phase(name, options=None, *, prefill, batch, queries, kv_len):
    """The BlockingConfig a phase runs for `name` (None for dense): any name `resolve` takes,
    its row's defaults clipped to the phase's sizes (never more blocks than batch rows,
    queries or keys, so a name alone fits any shape), then the alias's and the given options.

    batch, queries, kv_len: the phase's B, S and the shortest key axis it attends over.
    """
    resolved = resolve(name, prefill=prefill)
    if resolved is None:
        if options:
            raise ValueError(f"dense attention ({name!r}) takes no options, got {options}")
        return None
    base, implied = resolved
    limits = {
        "num_batch_blocks": batch,
        "num_q_blocks": queries,
        "prefill_block_chunks": queries,
        "num_kv_blocks": kv_len,
    }
    defaults = {k: min(v, limits.get(k, v)) for k, v in mode(base).defaults.items()}
    return BlockingConfig(mode=base, **{**defaults, **implied, **(options or {})})


def markdown_table():
    """docs/attention.md's table of modes, generated from `TABLE` (a test keeps them equal)."""
    rows = ["| mode | cut axes | KV blocks | math | options (defaults) |", "|---|---|---|---|---|"]
    for m in TABLE:
        options = ", ".join(f"`{k}={v}`" for k, v in m.defaults.items())
        rows.append(f"| `{m.name}` | {' × '.join(m.axes)} | {m.kv} | {m.math} | {options} |")
    return "\n".join(rows)


# The option that sets each axis's block count; prefill modes cut queries by prefill_block_chunks.
_AXIS_OPTION = {
    "b": "num_batch_blocks",
    "h": "head_block_size",
    "q": "num_q_blocks",
    "kv": "num_kv_blocks",
    "r": "prefill_n_rep_chunk",
}

# qaic_config keys that differ from ours; everything else keeps QEfficient's name.
_QAIC_ALIASES = {"kv_blocking_headpar_split": "headpar_split", "n_rep_chunk": "prefill_n_rep_chunk"}


def _count_option(mode, axis):
    if axis == "q" and mode.startswith("prefill_"):
        return "prefill_block_chunks"
    return _AXIS_OPTION[axis]


def _count_options(mode):
    """The block-count options a mode reads."""
    return {_count_option(mode, axis) for axis in _AXES[mode].split()}


@dataclasses.dataclass(frozen=True)
class BlockingConfig:
    """One blocked-attention setting; option names and meanings follow QEfficient.

    mode: one of `MODES`. num_kv_blocks / num_q_blocks / num_batch_blocks: block counts along
    the cache, the queries and the batch. head_block_size: query heads per head block (a
    multiple or a divisor of the GQA group size). headpar_split: cut each KV block into this
    many pieces computed independently (0 = `num_cores`, default the number of JAX devices).
    batch_fold: the cache arrives as `[1, B·Hkv, T, D]` (row b·Hkv + h). prefill_block_chunks:
    query chunks of a prefill mode. prefill_n_rep_chunk: query heads per chunk within one GQA
    group (default the whole group). skip_kv: leave the running state untouched for KV blocks
    no query sees. ctx_len: compile-time cache length the KV block size derives from (default
    the cache length T). ordered (not a QEfficient key): make every block's queries depend on
    the previous block's state, so a scheduler that runs independent matmuls early (XLA:CPU)
    keeps one block's scores live instead of all of them; costs a scalar sum and an add per
    block, and serializes blocks a compiler could otherwise overlap.
    """

    mode: str
    num_kv_blocks: int | None = None
    num_q_blocks: int | None = None
    head_block_size: int | None = None
    num_batch_blocks: int | None = None
    headpar_split: int | None = None
    batch_fold: bool = False
    prefill_block_chunks: int | None = None
    prefill_n_rep_chunk: int | None = None
    skip_kv: bool = False
    ctx_len: int | None = None
    num_cores: int | None = None
    ordered: bool = False

    def __post_init__(self):
        if self.mode not in _AXES:
            raise ValueError(f"unknown blocking mode {self.mode!r}; expected one of {MODES}")
        used = _count_options(self.mode)
        for option in (*_AXIS_OPTION.values(), "prefill_block_chunks"):
            value = getattr(self, option)
            if value is None:
                if option in used and option != "prefill_n_rep_chunk":
                    raise ValueError(f"mode {self.mode!r} needs {option}")
                continue
            if option not in used:
                raise ValueError(f"{option}={value} is not used by mode {self.mode!r}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{option} must be an int >= 1, got {value!r}")
        for name in ("headpar_split", "ctx_len", "num_cores"):
            value = getattr(self, name)
            lowest = 0 if name == "headpar_split" else 1
            if value is not None and (not isinstance(value, int) or value < lowest):
                raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")
        if self.headpar_split is not None and "kv" not in self.axes:
            raise ValueError(f"headpar_split needs a mode that blocks the cache, not {self.mode!r}")
        if self.num_cores is not None and self.headpar_split != 0:
            raise ValueError("num_cores only sets headpar_split=0; give headpar_split=0 with it")
        if self.batch_fold and "b" in self.axes:
            raise ValueError(f"batch_fold folds the batch away; mode {self.mode!r} blocks it")

    @property
    def axes(self):
        """The block axes of this mode, e.g. `("h", "q", "kv")`."""
        return tuple(_AXES[self.mode].split())

    def _count_option(self, axis):
        return _count_option(self.mode, axis)

    @classmethod
    def from_qaic_config(cls, qaic_config, *, prefill=False):
        """A config from a QEfficient `qaic_config` dict; None when it asks for no blocking.

        `prefill=True` reads `prefill_blocking_mode` (`"q"`, `"kv"`, `"qkv"`, `"online"`),
        otherwise `blocking_mode` (`"kv_headpar"` is `"kv"` with headpar_split, default 0).
        Keys the chosen mode does not use are dropped, since one qaic_config carries both the
        decode and the prefill settings; keys unrelated to blocking are ignored.
        """
        cfg = {_QAIC_ALIASES.get(key, key): value for key, value in qaic_config.items()}
        mode = cfg.get("prefill_blocking_mode" if prefill else "blocking_mode")
        if mode in (None, "none", "default"):
            return None
        if prefill:
            mode = f"prefill_{mode}"
        elif mode == "kv_headpar":
            mode = "kv"
            cfg.setdefault("headpar_split", 0)
        if mode not in _AXES:
            key = "prefill_blocking_mode" if prefill else "blocking_mode"
            raise ValueError(f"unknown {key} {qaic_config[key]!r} in qaic_config")
        used = _count_options(mode) | {"ctx_len", "skip_kv"}
        if "kv" in _AXES[mode].split():
            used |= {"headpar_split", "num_cores"}
        if "b" not in _AXES[mode].split():
            used.add("batch_fold")
        kwargs = {k: cfg[k] for k in used if cfg.get(k) is not None}
        if kwargs.get("headpar_split") != 0:
            kwargs.pop("num_cores", None)
        return cls(mode=mode, **kwargs)

    def plan(self, batch, heads, kv_heads, queries, cache_len, *, num_devices=1):
        """Static block boundaries for q `[B, H, S, D]` against a cache of T slots.

        batch, heads, kv_heads, queries, cache_len: B, H, Hkv, S, T (unfolded). num_devices:
        the default for headpar_split=0 without num_cores.
        """
        if heads % kv_heads:
            raise ValueError(f"query heads {heads} must be a multiple of kv heads {kv_heads}")
        group = heads // kv_heads
        symbolic = not isinstance(cache_len, int)  # a compute context length: exact blocks
        if symbolic and self.ctx_len is not None:
            raise ValueError(
                f"ctx_len={self.ctx_len} sizes KV blocks from a fixed length; a symbolic key "
                f"length ({cache_len}) is cut into exact blocks of its own"
            )
        ctx_len = cache_len if self.ctx_len is None else self.ctx_len
        if not symbolic and ctx_len < cache_len:
            raise ValueError(f"ctx_len={ctx_len} is shorter than the cache ({cache_len} slots)")
        if self.batch_fold:
            batch, heads, kv_heads = 1, batch * heads, batch * kv_heads
        axes = self.axes
        b_blocks = self._count(batch, "num_batch_blocks", "batch rows") if "b" in axes else 1
        q_blocks = self._count(queries, self._count_option("q"), "queries") if "q" in axes else 1
        kv_blocks = 1
        if "kv" in axes:
            kv_blocks = (
                self.num_kv_blocks
                if symbolic
                else self._count(ctx_len, "num_kv_blocks", "ctx_len slots")
            )
        split = self._split(num_devices)
        return Plan(
            batch=ranges(batch, b_blocks),
            heads=self._head_blocks(heads, kv_heads, group),
            q=ranges(queries, q_blocks),
            kv=ranges(cache_len, kv_blocks, ctx_len),
            split=split,
            parallel=self.headpar_split is not None or self.mode == "prefill_qkv",
            skip_kv=self.skip_kv,
            batch_fold=self.batch_fold,
            ordered=self.ordered,
        )

    def kv_multiple(self, num_devices=1):
        """What a symbolic key length must be a multiple of to cut into this mode's exact KV
        blocks (`ranges`), head-parallel pieces included: 1 when it blocks no cache."""
        if "kv" not in self.axes:
            return 1
        return self.num_kv_blocks * self._split(num_devices)

    def _split(self, num_devices):
        """Head-parallel pieces per KV block (1 unless headpar_split is set; 0 means
        num_cores, else the devices)."""
        if self.headpar_split is None:
            return 1
        return self.headpar_split or self.num_cores or num_devices

    def _count(self, n, option, what):
        value = getattr(self, option)
        if value > n:
            raise ValueError(f"{option}={value} is more blocks than the {n} {what}")
        return value

    def _head_blocks(self, heads, kv_heads, group):
        if "r" in self.axes:
            size = self.prefill_n_rep_chunk or group
            if group % size:
                raise ValueError(
                    f"prefill_n_rep_chunk={size} must divide the GQA group size {group}"
                )
        elif "h" in self.axes:
            size = self.head_block_size
            if size > heads:
                raise ValueError(f"head_block_size={size} is more than the {heads} query heads")
            if size % group and group % size:
                raise ValueError(
                    f"head_block_size={size} must be a multiple or a divisor of the GQA group "
                    f"size {group} (query heads per kv head)"
                )
        else:
            size = heads
        return head_blocks(heads, kv_heads, size)
