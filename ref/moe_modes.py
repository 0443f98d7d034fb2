"""How Gemma 4's experts run, named as QEfficient names them (no JAX: the command line reads it).

Every mode returns what the dense mode returns; only the work differs:

- `dense`: every expert on every token, mixed by the router's weights (zero outside the top-k).
- `gather`: per token, only its top-k experts' matrices, gathered (`QEffGemma4TextExperts`,
  QEfficient's decode graphs).
- `nsp`: experts split over `num_nsp` cores; per core and local expert, the tokens routed to it
  packed to the front and run in `packed_chunk`-row chunks (`QEffPrefillChunkedGemma4TextExperts`,
  QEfficient's prefill-only graphs: `num_nsp` = the compile's cores, chunk 256).

A mode is written `dense`, `gather` or `nsp[:num_nsp=N,packed_chunk=C]`.
"""

import dataclasses

NAMES = ("dense", "gather", "nsp")
# QEfficient's values: expert_blocking_num_nsp = the compile's num_cores (its default 16) and
# constants.MOE_PREFILL_PACKED_CHUNK_SIZE
NSP_DEFAULTS = {"num_nsp": 16, "packed_chunk": 256}


@dataclasses.dataclass(frozen=True)
class MoeMode:
    """One way to run the experts; hashable (a static argument of a jitted step).

    name: one of NAMES; num_nsp, packed_chunk: the nsp mode's cores and rows per chunk
    (None in the other modes).
    """

    name: str = "dense"
    num_nsp: int | None = None
    packed_chunk: int | None = None

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"MoE mode {self.name!r}: expected one of {', '.join(NAMES)}")
        counts = {"num_nsp": self.num_nsp, "packed_chunk": self.packed_chunk}
        if self.name != "nsp":
            given = [k for k, v in counts.items() if v is not None]
            if given:
                raise ValueError(f"MoE mode {self.name!r} takes no {', '.join(given)}")
            return
        for key, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MoE mode nsp: {key}={value!r}, expected an int >= 1")

    def __str__(self):
        if self.name != "nsp":
            return self.name
        return f"nsp:num_nsp={self.num_nsp},packed_chunk={self.packed_chunk}"

    def check(self, num_experts, tokens):
        """Raise ValueError unless this mode can run `num_experts` experts over `tokens` rows
        (T = batch · seq_len of one step): nsp needs num_nsp | E and packed_chunk | T."""
        if self.name != "nsp":
            return
        if num_experts % self.num_nsp:
            raise ValueError(
                f"MoE mode {self}: num_nsp={self.num_nsp} does not divide the {num_experts} "
                f"experts; expected a divisor of {num_experts}"
            )
        if tokens % self.packed_chunk:
            raise ValueError(
                f"MoE mode {self}: packed_chunk={self.packed_chunk} does not divide the "
                f"{tokens} tokens of a step (batch × seq_len); expected a divisor of {tokens}"
            )


def parse(mode, **defaults):
    """A MoeMode from None (dense), a MoeMode, or text `dense`, `gather`,
    `nsp[:num_nsp=N,packed_chunk=C]`; options left out take `defaults`, then NSP_DEFAULTS."""
    if mode is None:
        return MoeMode()
    if isinstance(mode, MoeMode):
        return mode
    if not isinstance(mode, str):
        raise ValueError(f"MoE mode {mode!r}: expected a MoeMode or text such as 'gather'")
    name, colon, rest = mode.partition(":")
    if name not in NAMES:
        raise ValueError(f"MoE mode {name!r} in {mode!r}: expected one of {', '.join(NAMES)}")
    if name != "nsp":
        if colon:
            raise ValueError(f"MoE mode {mode!r}: {name} takes no options")
        return MoeMode(name)
    options = {**NSP_DEFAULTS, **{k: v for k, v in defaults.items() if v is not None}}
    for item in rest.split(",") if rest else ():
        key, eq, value = item.partition("=")
        if not eq or key not in NSP_DEFAULTS:
            raise ValueError(f"{item!r} in MoE mode {mode!r}: expected num_nsp=N or packed_chunk=C")
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(f"{item!r} in MoE mode {mode!r}: expected an integer") from None
    return MoeMode("nsp", **options)


def for_phase(mode, phase, num_experts, tokens):
    """The MoeMode of one phase ("prefill" or "decode", named in errors as `moe_<phase>`)
    of a model with `num_experts` (0: no MoE block) over steps of `tokens` rows; a mode other
    than dense needs experts, nsp needs its counts to divide (`MoeMode.check`)."""
    try:
        parsed = parse(mode)
        if parsed.name != "dense" and not num_experts:
            raise ValueError("the model has no MoE block; expected dense (None)")
        parsed.check(num_experts, tokens)
    except ValueError as e:
        raise ValueError(f"moe_{phase}={mode!r}: {e}") from e
    return parsed
