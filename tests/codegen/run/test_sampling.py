"""`codegen.run.sampling`: run and serve sample as transformers' `generate` does by default,
from the checkpoint's generation_config.json (transformers' GenerationConfig, its generation
mode and its defaults, the oracle), greedy where the folder has none or do_sample is not true;
options win over it, and a sampled run's seed is drawn when none is given."""

import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GenerationConfig

from codegen.run.sampling import flag, sampling_of

ABSENT = object()
FIELDS = {
    "do_sample": st.sampled_from([True, False, None, 1]),
    "temperature": st.none() | st.floats(0.05, 4.0),
    "top_k": st.none() | st.integers(0, 100),
    "top_p": st.none() | st.floats(0.05, 1.0),
}
CONFIGS = st.none() | st.fixed_dictionaries(
    {}, optional={**FIELDS, "eos_token_id": st.just([1, 106, 50])}
)


def transformers_choice(config):
    """(samples?, {temperature, top_k, top_p}) as transformers' generate reads the file."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = GenerationConfig(**(config or {}))
    defaults = GenerationConfig._get_default_generation_params()
    values = {k: getattr(g, k) if getattr(g, k) is not None else defaults[k]
              for k in ("temperature", "top_k", "top_p")}  # fmt: skip
    return g.get_generation_mode() == "sample", values


@settings(max_examples=30, deadline=None)
@given(config=CONFIGS)
def test_the_checkpoints_sampling_is_transformers_default(config):
    samples, values = transformers_choice(config)
    got = sampling_of({}, config)
    assert (got is not None) == samples
    if samples:
        assert {k: getattr(got, k) for k in values} == values
        assert 0 <= got.seed < 2**31
    assert sampling_of({"greedy": True}, config) is None


@settings(max_examples=10, deadline=None)
@given(config=CONFIGS, top_k=st.integers(0, 9), seed=st.integers(0, 99))
def test_options_win(config, top_k, seed):
    """sample or a value samples whatever the file says, with its other values; a given seed is
    kept; two runs without a seed draw their own."""
    _, values = transformers_choice(config)
    got = sampling_of({"top_k": top_k, "seed": seed}, config)
    assert (got.temperature, got.top_k, got.top_p, got.seed) == (
        values["temperature"], top_k, values["top_p"], seed,
    )  # fmt: skip
    assert sampling_of({"sample": True, "seed": seed}, config).top_k == values["top_k"]


def test_drawn_seeds_differ_and_greedy_refuses_sampling_values():
    seeds = {sampling_of({"sample": True}, None).seed for _ in range(4)}
    assert len(seeds) > 1
    with pytest.raises(ValueError, match="^--greedy turns sampling off: expected no --sample, "
                       "--top-k$"):  # fmt: skip
        sampling_of({"greedy": True, "sample": True, "top_k": 3}, None, flag)
    with pytest.raises(ValueError, match="^greedy turns sampling off: expected no temperature"):
        sampling_of({"greedy": True, "temperature": 0.5}, {"do_sample": True})
