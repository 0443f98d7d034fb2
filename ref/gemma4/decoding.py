"""How each next token is chosen and when a row stops, host-side in numpy: what `Gemma4.generate`
and the ONNX runner (`codegen run`, `serve`) share.

- **Stop ids.** A row stops at its first id among the stop ids (kept in the output, as
  transformers keeps it); a finished row of a batch is padded with the pad id after it, and the
  batch ends when every row has stopped (`Gemma4ForConditionalGeneration.generate`'s rule).
  The ids come from the checkpoint's generation_config.json, else its config.json
  (`stop_ids`), one id or a list each.
- **Sampling.** transformers' warpers in its order: temperature, then top-k (every logit below
  the k-th largest removed; ties at the k-th kept), then top-p (the ascending-sorted
  probabilities whose cumulative sum is at most 1 − top_p removed, the largest always kept),
  then one draw from the softmax of what is left; greedy (argmax) when no `Sampling` is
  given. Among equal logits top-p removes the higher ids first (torch's sort leaves that order
  unspecified), as argmax keeps the lowest.
  The n-th token of row r draws from its own generator, seeded by (seed, r, n): a request's
  tokens depend on its seed alone, not on the batch or the slot it runs in (`serve` draws each
  request as row 0).
- **Suppressed ids.** generation_config.json's `suppress_tokens` can never be chosen, and its
  `begin_suppress_tokens` not as the first generated token (`Suppress`): their logits are
  −inf before the warpers and the argmax, as transformers' `SuppressTokensLogitsProcessor`
  and `SuppressTokensAtBeginLogitsProcessor` set them (the 12B-it suppresses its end of
  audio and end of image, 258883 and 258882). An id past the vocabulary is ignored, as there.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: temperature > 0, top_k ≥ 0 (0: off), top_p in (0, 1] (1: off),
    seed ≥ 0."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not (isinstance(t, int | float) and np.isfinite(t) and t > 0):
            raise ValueError(f"temperature={t!r}: expected a finite number > 0")
        if not (isinstance(k, int) and k >= 0):
            raise ValueError(f"top_k={k!r}: expected an int >= 0 (0: no top-k)")
        if not (isinstance(p, int | float) and 0 < p <= 1):
            raise ValueError(f"top_p={p!r}: expected a number in (0, 1] (1: no top-p)")
        if not (isinstance(s, int) and s >= 0):
            raise ValueError(f"seed={s!r}: expected an int >= 0")

    @classmethod
    def from_generation_config(cls, generation_config=None, **overrides):
        """Sampling with the defaults of a generation_config.json dict (temperature, top_k,
        top_p; absent or null keys: transformers' 1.0, 50, 1.0), then `overrides` that are not
        None."""
        g = generation_config or {}
        found = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
        found.update({k: g[k] for k in found if g.get(k) is not None})
        found.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**found)


@dataclass(frozen=True)
class Suppress:
    """Ids no step may choose (`every`), and ids the first generated token may not be
    (`first`); empty: nothing suppressed."""

    every: tuple = ()
    first: tuple = ()

    @classmethod
    def from_generation_config(cls, generation_config=None):
        """generation_config.json's `suppress_tokens` and `begin_suppress_tokens` (absent or
        null: none)."""
        g = generation_config or {}
        every = _as_ids(g.get("suppress_tokens"), "suppress_tokens")
        first = _as_ids(g.get("begin_suppress_tokens"), "begin_suppress_tokens")
        return cls(tuple(every), tuple(first))

    def __bool__(self):
        return bool(self.every or self.first)

    def __call__(self, logits, step):
        """logits [..., V] with −inf at the ids suppressed at generated token `step` (0: the
        first), float32; ids ≥ V ignored."""
        ids = [i for i in self.every + (self.first if step == 0 else ()) if i < logits.shape[-1]]
        out = np.array(logits, np.float32)
        out[..., ids] = -np.inf
        return out


def _as_ids(value, name="eos_token_id"):
    """One id, a list of ids, or None → a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list | tuple) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} {value!r}: expected an id >= 0 or a list of them")
    return list(values)


def stop_ids(generation_config=None, config=None):
    """The stop ids of a checkpoint: generation_config.json's `eos_token_id` when it names any,
    else config.json's (top level, then `text_config`), deduplicated in order → tuple of ints.

    generation_config, config: the files' dicts (or None)."""
    if generation_config and _as_ids(generation_config.get("eos_token_id")):
        return tuple(dict.fromkeys(_as_ids(generation_config["eos_token_id"])))
    config = config or {}
    found = _as_ids(config.get("eos_token_id"))
    found += _as_ids((config.get("text_config") or {}).get("eos_token_id"))
    return tuple(dict.fromkeys(found))


def pad_id(generation_config=None, config=None):
    """The pad id transformers pads a finished row with: generation_config's, else config's (top
    level, then `text_config`), else 0."""
    for source in (generation_config or {}, config or {}, (config or {}).get("text_config") or {}):
        if source.get("pad_token_id") is not None:
            return int(source["pad_token_id"])
    return 0


def generation_ids(generation_config=None, config=None):
    """(stop ids, pad id, `Suppress`) of a checkpoint: its generation_config.json and
    config.json dicts (or None), as `stop_ids`, `pad_id` and `Suppress` read them."""
    stop = stop_ids(generation_config, config)
    pad = pad_id(generation_config, config)
    return stop, pad, Suppress.from_generation_config(generation_config)


def warp(logits, sampling):
    """transformers' temperature, top-k and top-p warpers on one row: [V] → [V] float64, −inf
    where a token cannot be drawn."""
    z = np.asarray(logits, np.float64) / sampling.temperature
    if sampling.top_k:
        kth = np.sort(z)[-min(sampling.top_k, z.size)]
        z = np.where(z < kth, -np.inf, z)
    if sampling.top_p < 1:
        # ascending, equal logits with the higher id first: removed first, as argmax keeps
        # the lowest id of equal ones
        order = np.lexsort((-np.arange(z.size), z))
        ascending = z[order]
        p = np.exp(ascending - ascending[-1])
        cumulative = np.cumsum(p / p.sum())
        remove = cumulative <= 1 - sampling.top_p
        remove[-1] = False
        z[order[remove]] = -np.inf
    return z


def draw(logits, sampling, row, step, suppress=None):
    """One token of one row: argmax without sampling, else a draw from the warped softmax with
    the generator of (seed, row, step); never a `suppress`ed id. logits: [V] → int."""
    if suppress:  # None or an empty Suppress: nothing suppressed
        logits = suppress(logits, step)
    if sampling is None:
        return int(np.argmax(logits))
    z = warp(logits, sampling)
    p = np.exp(z - z.max())
    u = np.random.default_rng([sampling.seed, row, step]).random()
    cumulative = np.cumsum(p)
    return int(min(np.searchsorted(cumulative, u * cumulative[-1], side="right"), z.size - 1))


def choose(logits, sampling, step, rows=None, suppress=None):
    """The next token of each row. logits: [B, V]; rows: each row's index for its generator
    (default 0 … B−1); suppress: a `Suppress` (None: nothing suppressed) → [B] int32."""
    logits = np.asarray(logits)
    rows = range(len(logits)) if rows is None else rows
    return np.array(
        [draw(x, sampling, r, step, suppress) for x, r in zip(logits, rows, strict=True)],
        np.int32,
    )


class Stopper:
    """transformers' end of generation over a batch: each row's tokens after its first stop id
    become the pad id, and `done` once every row has stopped.

    stop: iterable of stop ids (empty: never stop); pad: the pad id; batch: B."""

    def __init__(self, stop, pad, batch):
        self.stop = np.array(sorted(set(stop)), np.int64)
        self.pad = int(pad)
        self.running = np.ones(batch, bool)

    def __call__(self, tokens):
        """One step's tokens [B] → the same with finished rows' tokens replaced by the pad id."""
        out = np.where(self.running, tokens, self.pad).astype(np.int32)
        self.running &= ~np.isin(out, self.stop)
        return out

    @property
    def done(self):
        return not self.running.any()
