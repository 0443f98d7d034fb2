"""The command line's value readers: each turns one argument's text into its value, or raises
`argparse.ArgumentTypeError` naming the text and what was expected (the commands' argument
modules, `codegen.cli.*_args`, use them)."""

import argparse

from ref import moe_modes
from ref.blocking import DENSE_NAMES
from ref.blocking import names as blocking_names


def int_list(text):
    """Integers from comma-separated text (vision budgets, compute context lengths)."""
    try:
        return tuple(int(b) for b in text.split(",") if b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def tiles(text):
    """(query tiles, KV tiles) from QxKV, or Q for Q×Q."""
    q, _, kv = text.partition("x")
    try:
        return int(q), int(kv or q)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected QxKV or Q, e.g. 5x5") from None


def mode_options(text, known):
    """(mode, {option: value}) from MODE or MODE:opt=value,opt=value."""
    mode, _, rest = text.partition(":")
    if mode not in known:
        raise argparse.ArgumentTypeError(
            f"unknown blocking mode {mode!r}; expected one of {', '.join(known)}"
        )
    options = {}
    for item in rest.split(",") if rest else ():
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r}: expected option=value")
        if value.lower() in ("true", "false"):
            options[key] = value.lower() == "true"
        else:
            try:
                options[key] = int(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{item!r}: expected an integer value") from None
    return mode, options


def blocking_modes(text):
    """An attention graph's MODE[:opt=value,...] (options left out take the mode's defaults in
    `ref.blocking.TABLE`, clipped to the graph's sizes); `all` is every mode and alias with its
    defaults, and `none` (dense)."""
    every = [n for n in blocking_names() if n not in DENSE_NAMES]
    if text == "all":
        return [(m, {}) for m in every] + [("none", {})]
    return [mode_options(text, ["all", *DENSE_NAMES, *every])]


def phase_blocking(text):
    """A model graph's MODE[:opt=value,...] (options left out: the mode's defaults)."""
    return mode_options(text, list(blocking_names(prefill=True)))


def moe_mode(text):
    """An export's MoE mode text (`ref.moe_modes`: dense, gather, nsp[:num_nsp=N,packed_chunk=C]),
    checked here, kept as text: nsp's counts left out are filled in per graph."""
    try:
        moe_modes.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def token_ids(text):
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids") from None


def grid(text):
    h, x, w = text.lower().partition("x")
    if not (x and h.isdigit() and w.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected HxW in patches, e.g. 6x9")
    return int(h), int(w)


def graph_kinds(text):
    kinds = tuple(k for k in text.split(",") if k)
    if not kinds or set(kinds) - {"model", "attention"}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected model, attention or model,attention")
    return kinds
