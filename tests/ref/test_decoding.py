"""Sampling and stopping (`ref.gemma4.decoding`) against a numpy oracle of transformers' warpers
written here from their definitions (descending order and tail sums, not the module's ascending
cumulative sum), on drawn logits."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref.gemma4.decoding import Sampling, Stopper, Suppress, choose, draw, pad_id, stop_ids
from tests.util import examples


def allowed(logits, temperature, top_k, top_p):
    """The tokens transformers' temperature → top-k → top-p warpers leave, and their
    probabilities: (bool [V], float64 [V] summing to 1 over the allowed)."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones(z.size, bool)
    if top_k:
        kth = sorted(z.tolist(), reverse=True)[min(top_k, z.size) - 1]
        keep &= z >= kth
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1:
        order = sorted(range(z.size), key=lambda i: -p[i])
        tail = 0.0
        for i in reversed(order):  # from the smallest: the mass at or below each token
            tail += p[i]
            if tail <= 1 - top_p and i != order[0]:
                keep[i] = False
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return keep, p


@st.composite
def cases(draw_, ties=False):
    v = draw_(st.integers(2, 40))
    if ties:
        logits = np.array(
            draw_(st.lists(st.sampled_from([-1.0, 0.0, 2.5]), min_size=v, max_size=v))
        )
    else:
        logits = np.random.default_rng(draw_(st.integers(0, 2**32 - 1))).normal(0, 3, v)
    sampling = Sampling(
        temperature=draw_(st.sampled_from([0.3, 0.7, 1.0, 1.6])),
        top_k=draw_(st.integers(0, v + 2)),
        top_p=draw_(st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1])),
        seed=draw_(st.integers(0, 2**31)),
    )
    return logits, sampling


@settings(max_examples=examples(60), deadline=None)
@given(case=st.one_of(cases(), cases(ties=True)), step=st.integers(0, 500))
def test_draws_stay_in_the_top_k_top_p_set(case, step):
    logits, sampling = case
    keep, _ = allowed(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    tokens = [draw(logits, sampling, row, step) for row in range(8)]
    assert all(keep[t] for t in tokens), (tokens, np.flatnonzero(keep))
    # reproducible: the same (seed, row, step) draws the same token
    assert tokens == [draw(logits, sampling, row, step) for row in range(8)]


@settings(max_examples=examples(30), deadline=None)
@given(case=cases())
def test_top_k_one_is_greedy(case):
    logits, sampling = case
    greedy = Sampling(sampling.temperature, 1, sampling.top_p, sampling.seed)
    rows = np.stack([logits, -logits, logits[::-1]])
    np.testing.assert_array_equal(choose(rows, greedy, 7), choose(rows, None, 7))
    np.testing.assert_array_equal(choose(rows, None, 0), np.argmax(rows, axis=-1))


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 4, 1.0), (1.3, 0, 0.7), (0.8, 5, 0.9)]
)
def test_draws_follow_the_warped_distribution(temperature, top_k, top_p):
    """4,000 draws over steps: each token's frequency within 4.5 standard errors of the oracle's
    probability (a draw from the unwarped softmax, or one that skips top-p, is off by more)."""
    logits = np.array([2.0, 1.5, 1.2, 0.4, 0.0, -0.3, -1.0, -2.5])
    _, p = allowed(logits, temperature, top_k, top_p)
    sampling = Sampling(temperature, top_k, top_p, seed=11)
    n = 4000
    counts = np.bincount([draw(logits, sampling, 0, s) for s in range(n)], minlength=logits.size)
    err = np.sqrt(np.maximum(p * (1 - p), 1e-4) / n)
    np.testing.assert_array_less(np.abs(counts / n - p), 4.5 * err + 1e-12)


def test_seeds_and_rows_draw_differently():
    logits = np.zeros(50)
    tokens = lambda seed, row: [
        draw(logits, Sampling(seed=seed, top_k=0), row, s) for s in range(20)
    ]  # noqa: E731
    assert tokens(1, 0) == tokens(1, 0)
    assert tokens(1, 0) != tokens(2, 0)
    assert tokens(1, 0) != tokens(1, 1)


def test_stopper_pads_after_the_first_stop_id_and_ends_when_all_stopped():
    stop = Stopper([1, 106], pad=0, batch=3)
    np.testing.assert_array_equal(stop(np.array([5, 106, 7])), [5, 106, 7])
    assert not stop.done
    np.testing.assert_array_equal(stop(np.array([1, 9, 9])), [1, 0, 9])
    np.testing.assert_array_equal(stop(np.array([3, 3, 1])), [0, 0, 1])
    assert stop.done
    never = Stopper([], pad=0, batch=1)
    never(np.array([1]))
    assert not never.done


def test_stop_ids_from_generation_config_then_config():
    config = {"eos_token_id": 1, "text_config": {"eos_token_id": [1, 106]}, "pad_token_id": 0}
    assert stop_ids({"eos_token_id": [1, 106, 50, 1]}, config) == (1, 106, 50)
    assert stop_ids({"eos_token_id": 7}, config) == (7,)
    assert stop_ids({"do_sample": True}, config) == (1, 106)
    assert stop_ids(None, {"text_config": {"eos_token_id": 3}}) == (3,)
    assert stop_ids(None, {}) == ()
    assert pad_id({"pad_token_id": 5}, config) == 5
    assert pad_id(None, {"text_config": {"pad_token_id": 9}}) == 9
    assert pad_id(None, {}) == 0
    with pytest.raises(ValueError, match=r"eos_token_id \[1, 'x'\]: expected an id >= 0"):
        stop_ids({"eos_token_id": [1, "x"]})


def test_sampling_defaults_and_refusals():
    g = {"do_sample": True, "temperature": 0.6, "top_k": 64, "top_p": 0.95}
    assert Sampling.from_generation_config(g) == Sampling(0.6, 64, 0.95, 0)
    assert Sampling.from_generation_config(g, top_k=5, seed=3, top_p=None) == Sampling(
        0.6, 5, 0.95, 3
    )
    assert Sampling.from_generation_config(None) == Sampling(1.0, 50, 1.0, 0)
    for bad, match in [
        (dict(temperature=0), "temperature=0: expected a finite number > 0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(top_p=0), r"top_p=0: expected a number in \(0, 1\]"),
        (dict(seed=-2), "seed=-2"),
    ]:
        with pytest.raises(ValueError, match=match):
            Sampling(**bad)


@settings(max_examples=examples(20))
@given(
    logits=st.lists(st.floats(-5, 5), min_size=6, max_size=12),
    every=st.sets(st.integers(0, 14), max_size=3),
    first=st.sets(st.integers(0, 14), max_size=2),
    step=st.integers(0, 2),
    seed=st.integers(0, 2**31 - 1),
)
def test_suppressed_ids_are_never_chosen(logits, every, first, step, seed):
    """generation_config's suppress_tokens at every step and begin_suppress_tokens at the first
    (ids past the vocabulary ignored, as transformers' processors ignore them): greedy takes
    the argmax of the rest, sampling never draws them."""
    v = len(logits)
    barred = {i for i in every | (first if step == 0 else set()) if i < v}
    suppress = Suppress.from_generation_config(
        {"suppress_tokens": sorted(every), "begin_suppress_tokens": sorted(first)}
    )
    x = np.asarray(logits, np.float32)
    if len(barred) < v:
        rest = [i for i in range(v) if i not in barred]
        assert draw(x, None, 0, step, suppress) == rest[int(np.argmax(x[rest]))]
        sampled = draw(x, Sampling(top_k=0, seed=seed), 0, step, suppress)
        assert sampled not in barred
    assert choose(x[None], None, step, suppress=None)[0] == int(np.argmax(x))


def test_suppress_reads_generation_config_and_refuses_bad_ids():
    assert not Suppress.from_generation_config(None)
    assert not Suppress.from_generation_config({"suppress_tokens": None})
    twelve = {"suppress_tokens": [258883, 258882]}  # the 12B-it's generation_config.json
    assert Suppress.from_generation_config(twelve) == Suppress((258883, 258882), ())
    with pytest.raises(ValueError, match=r"begin_suppress_tokens \[-1\]: expected an id >= 0"):
        Suppress.from_generation_config({"begin_suppress_tokens": [-1]})
