"""Continuous batching in `ref`: requests join free cache slots between decode steps, each is
prefilled alone into its slot (`step(..., batch_index)`, QEfficient's `batch_index`), every
occupied slot decodes together, and a request leaves at its own length. Each request's tokens
equal transformers' `generate` on that request alone."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ref.attention import blocked, reference
from ref.blocking import BlockingConfig
from ref.cache import fold
from ref.gemma4 import Gemma4
from ref.gemma4.kv_cache import init_cache
from ref.gemma4.schedule import chunk_arrays, chunk_bounds, image_runs
from ref.gemma4.step import step
from tests.hf_vision import tree_of
from tests.text_oracle import IMAGE, hf_model, hf_request, text_config
from tests.util import examples

SLOTS, CTX, CHUNK = 3, 48, 8
MARGIN = 1e-4
_MODELS = {}
# QEfficient's kv_batch_fold decode: the cache [1, SLOTS·Hkv, T, hd], KV blocks of 16 slots
FOLDED = functools.partial(blocked, config=BlockingConfig(mode="kv", batch_fold=True,
                                                          num_kv_blocks=3))  # fmt: skip
# kv blocks over the cache's slots, each block's rows gathered for the step (`cache_rows`)
BLOCKED = functools.partial(blocked, config=BlockingConfig(mode="kv", num_kv_blocks=3))


def models():
    if not _MODELS:
        layers = ["sliding_attention", "full_attention", "sliding_attention"]
        hf = hf_model(text_config(moe=False, layer_types=layers, ple=8, window=5), seed=13)
        _MODELS["pair"] = hf, Gemma4.from_params(hf.config.to_dict(), tree_of(hf.state_dict()))
    return _MODELS["pair"]


def prefill_into(model, cache, slot, ids, soft, attention=reference):
    """Prefill one request into cache slot `slot`, chunk by chunk → (cache, first token)."""
    run = dict(config=model.config, last_only=True, attention=attention)
    vision = None if soft is None else jnp.asarray(soft[None])
    image_idx = None if soft is None else jnp.zeros((1, 1), jnp.int32)
    bounds = chunk_bounds(len(ids), image_runs(ids, IMAGE), CHUNK)
    for k in range(len(bounds)):
        chunk, pos = chunk_arrays([ids], [bounds], k, 1, CHUNK)
        out = step(
            model.params, model.lm_head, cache, chunk, pos, vision, image_idx,
            jnp.array([[slot]], jnp.int32), **run,
        )  # fmt: skip
        cache, image_idx = out["cache"], out.get("image_idx")
    return cache, int(jnp.argmax(out["logits"][0, 0]))


def serve(model, requests, kernel="dense"):
    """requests: (arrival step, ids, soft tokens or None, new tokens) → tokens per request.
    kernel "dense": `reference` throughout; "blocked": prefill (into its slot of the whole
    cache) and decode attend in kv blocks (`BLOCKED`); "folded": every layer's keys and values
    held batch-folded ([1, SLOTS·Hkv, T, hd]), decode attending in `kv_batch_fold` blocks
    (`FOLDED`)."""
    cache = init_cache(model.config, SLOTS, CTX, slots_only=True)
    decode, prefill = dict(config=model.config), reference
    if kernel == "folded":
        cache = {n: {i: fold(x) for i, x in kv.items()} for n, kv in cache.items()}
        decode["attention"] = FOLDED
    elif kernel == "blocked":
        decode["attention"] = prefill = BLOCKED
    slot_of, position, last, done = {}, {}, {}, {i: [] for i in range(len(requests))}
    waiting = list(range(len(requests)))
    t = 0
    while waiting or slot_of:
        for r in [r for r in waiting if requests[r][0] <= t]:
            free = sorted(set(range(SLOTS)) - set(slot_of.values()))
            if not free:
                break
            waiting.remove(r)
            _, ids, soft, _ = requests[r]
            slot_of[r] = free[0]
            cache, last[r] = prefill_into(model, cache, free[0], ids, soft, prefill)
            done[r].append(last[r])
            position[r] = len(ids)
        for r in [r for r in slot_of if len(done[r]) == requests[r][3]]:
            del slot_of[r]  # leaves: its slot is free for the next arrival
        if slot_of:
            ids = np.zeros((SLOTS, 1), np.int32)
            pos = np.full((SLOTS, 1), -1, np.int32)
            for r, s in slot_of.items():
                ids[s, 0], pos[s, 0] = last[r], position[r]
            out = step(model.params, model.lm_head, cache, ids, pos, **decode)
            cache = out["cache"]
            for r, s in slot_of.items():
                last[r] = int(jnp.argmax(out["logits"][s, -1]))
                done[r].append(last[r])
                position[r] += 1
        t += 1
    return [np.array(done[i]) for i in range(len(requests))]


@pytest.mark.parametrize("kernel", ["dense", "blocked", "folded"])
@settings(max_examples=examples(2))
@given(
    lengths=st.lists(st.integers(3, 18), min_size=6, max_size=6),
    images=st.lists(st.booleans(), min_size=6, max_size=6),
    new=st.lists(st.integers(2, 7), min_size=6, max_size=6),
    arrivals=st.lists(st.integers(0, 6), min_size=6, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_each_request_gets_transformers_tokens(lengths, images, new, arrivals, seed, kernel):
    """Also attending in kv blocks, a prefill reading its slot of the whole cache block by
    block; and with the cache held batch-folded (QEfficient's kv_batch_fold layout) and decode
    in kv_batch_fold blocks: the prefill writes its slot's rows inside the folded cache. Each
    request decodes its own count of tokens and neither side stops at `<eos>` (this scheduler
    has no stop ids; before, a draw whose transformers tokens reached `<eos>` failed)."""
    hf, ours = models()
    rng = np.random.default_rng(seed)
    requests, want = [], []
    for length, has_image, n, arrival in zip(lengths, images, new, arrivals, strict=True):
        grids = [(6, 6)] if has_image else []
        ids, patches, tokens, gap = hf_request(hf, rng, length, grids, n, eos=None)
        assume(gap > MARGIN)
        soft = np.asarray(ours.vision.embed(patches, grids)[0]) if grids else None
        requests.append((arrival, ids, soft, n))
        want.append(tokens)
    got = serve(ours, sorted(requests, key=lambda r: r[0]), kernel)
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    for i, r in enumerate(order):
        np.testing.assert_array_equal(got[i], want[r])


def test_batch_index_is_checked():
    _, ours = models()
    cache = init_cache(ours.config, SLOTS, CTX, slots_only=True)
    ids = np.zeros((2, 1), np.int32)
    pos = np.zeros((2, 1), np.int32)
    for bad in ([[1], [1]], [[3], [0]], [[-2], [0]]):
        with pytest.raises(ValueError, match="expected distinct cache slots in"):
            step(ours.params, None, cache, ids, pos, None, None, np.array(bad), config=ours.config)
