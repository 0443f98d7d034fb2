"""How `run` and `serve` choose each next token: greedy, or sampling as transformers' `generate`
samples by default, following the checkpoint's generation_config.json (copied into the export):
its `do_sample` turns sampling on, with its temperature, top_k and top_p
(`ref.gemma4.decoding.Sampling`); greedy where the folder has no generation_config.json or
do_sample is false. Options (run's flags, a request's keys) win: greedy turns sampling off,
sample or a temperature/top_k/top_p turns it on; a sampled row's seed is the given one, else
drawn and printed so that the run can be repeated. Also the stop ids of --eos-id/--ignore-eos.
"""

import secrets

from ref.gemma4.decoding import Sampling

# run's options and a request's keys of how tokens are chosen
KEYS = ("greedy", "sample", "temperature", "top_k", "top_p", "seed")
VALUES = ("temperature", "top_k", "top_p")


def sampling_of(options, generation_config, name=str):
    """The sampling of `options` ({key: value or None} of KEYS) → None (greedy) or Sampling.

    greedy: None (refused beside sample or a value); sample or a value given, or
    generation_config's do_sample: Sampling with the values not given from
    generation_config.json (transformers' defaults where it names none) and the given seed, else
    a drawn one. name: how an error names a key (run: its flag)."""
    asked = [k for k in ("sample", *VALUES) if _given(options.get(k))]
    if options.get("greedy"):
        if asked:
            raise ValueError(
                f"{name('greedy')} turns sampling off: expected no {', '.join(map(name, asked))}"
            )
        return None
    if not asked and (generation_config or {}).get("do_sample") is not True:
        return None
    seed = options.get("seed")
    seed = drawn_seed() if seed is None else seed
    values = {k: options.get(k) for k in VALUES}
    return Sampling.from_generation_config(generation_config, **values, seed=seed)


def _given(value):
    """Whether an option is given: not None, and not False (0 is a value: top_k 0, no top-k)."""
    return value is not None and value is not False


def drawn_seed():
    """A fresh seed in [0, 2³¹) (the sampling's own, printed so that it can be given again)."""
    return secrets.randbelow(2**31)


def described(sampling):
    """One line saying how tokens are chosen: greedy, or the sampling values and the seed."""
    if sampling is None:
        return "greedy"
    s = sampling
    return f"sampling: temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, seed {s.seed}"


def options_of(args):
    """run's or serve's flags of KEYS as {key: value or None}."""
    return {k: getattr(args, k, None) for k in KEYS}


def flag(key):
    """The command-line flag of a key (top_k → --top-k)."""
    return "--" + key.replace("_", "-")


def stop_of(eos_id, ignore_eos):
    """The stop ids of --eos-id / --ignore-eos: None (the export's), (), or the given ids."""
    if ignore_eos:
        return ()
    return None if eos_id is None else tuple(int(i) for i in eos_id)
