"""Speculative decoding with Gemma 4's MTP assistant (`ref.gemma4.assistant`,
`ref.gemma4.speculative`): the drafter against transformers' Gemma4AssistantForCausalLM, its
first drafts against transformers' candidate generator, tokens against the target alone and
transformers' `generate(assistant_model=)`, and the round's bookkeeping under drawn acceptance
patterns (a scripted drafter), with sliding rings and stop ids."""

import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ref.cache import put_rows
from ref.gemma4 import speculative
from ref.gemma4.assistant import AssistantConfig, AssistantModel, draft_keys, shared_layers
from ref.gemma4.kv_cache import init_cache
from ref.gemma4.model import Gemma4
from ref.gemma4.step import step
from ref.gemma4.text_config import FULL, SLIDING, TextConfig
from ref.gemma4.unified_model import Gemma4Unified
from tests.assistant_oracle import assistant_config, assistant_params, hf_assistant
from tests.hf_vision import patches_for, tree_of
from tests.text_oracle import hf_generate, hf_model, prompt, text_config
from tests.util import examples, jitted, rel_err

WINDOW = 5
TARGETS = {  # (layer types, KV-shared layers, attention_k_eq_v, MoE)
    "dense": (["sliding_attention", "sliding_attention", "full_attention"], 0, True, False),
    "moe": (["sliding_attention", "full_attention"] * 2, 2, False, True),
}
_MODELS = {}


def _target(kind):
    """(text config dict, transformers model, ours) of a tiny target."""
    if kind not in _MODELS:
        layers, shared, k_eq_v, moe = TARGETS[kind]
        text = text_config(moe=moe, layer_types=layers, shared=shared, k_eq_v=k_eq_v, ple=8,
                           window=WINDOW)  # fmt: skip
        hf = hf_model(text, seed=7)
        _MODELS[kind] = text, hf, Gemma4.from_params(hf.config.to_dict(), tree_of(hf.state_dict()))
    return _MODELS[kind]


def _assistant(text, layer_types, *, ordered, tied=True, drafts=None, seed=5, unified=False):
    config = assistant_config(text, layer_types, ordered=ordered, tied=tied, unified=unified)
    hf = hf_assistant(config, seed, drafts=drafts)
    generation = {"num_assistant_tokens": drafts}  # as the checkpoint's generation_config
    return hf, AssistantModel.from_params(config, assistant_params(hf), generation)


@settings(max_examples=examples(5), deadline=None)
@given(
    ordered=st.booleans(),
    tied=st.booleans(),
    k_eq_v=st.booleans(),
    layers=st.lists(st.sampled_from([SLIDING, FULL]), min_size=1, max_size=3),
    position=st.integers(1, 20),
    stale=st.integers(0, 4),
    seed=st.integers(0, 2**16),
    unified=st.booleans(),
)
def test_the_drafter_equals_transformers(ordered, tied, k_eq_v, layers, position, stale, seed,
                                         unified):  # fmt: skip
    """Logits and projected state of one draft step, ≤ 1e-5, the target's keys at positions
    0 … P − 1 (P drawn past the window) plus `stale` slots at or after P (a rejected draft's
    key, an empty slot) that ours must not read; transformers is given the P keys alone, as
    its candidate generator gives them in a first round. `unified`: the 12B Unified's
    drafter (Gemma4UnifiedAssistantForCausalLM, a gemma4_unified_text decoder)."""
    target = text_config(moe=False, layer_types=[SLIDING, FULL], k_eq_v=k_eq_v, window=WINDOW)
    hf, ours = _assistant(target, layers, ordered=ordered, tied=tied, seed=seed, unified=unified)
    config = TextConfig.from_hf(target)
    rng = np.random.default_rng(seed)
    embeds, h = (rng.normal(size=(1, 1, 32)).astype(np.float32) for _ in range(2))
    kv, keys = {}, {}
    slots = position + stale
    for kind, layer in shared_layers(config).items():
        shape = (1, config.kv_heads[layer], slots, config.head_dims[layer])
        k, v = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
        kv[kind] = (torch.from_numpy(k[:, :, :position]), torch.from_numpy(v[:, :, :position]))
        keys[kind] = (*draft_keys(k, v, np.arange(slots)[None], position), None)
    got = ours.apply(embeds, h, np.array([[position]]), keys)
    with torch.no_grad():
        want = hf(inputs_embeds=torch.from_numpy(np.concatenate([embeds, h], -1)),
                  attention_mask=torch.ones(1, position + 1, dtype=torch.long),
                  position_ids=torch.tensor([[position]]), shared_kv_states=kv)  # fmt: skip
    assert rel_err(got["logits"], want.logits.numpy()) < 1e-5
    assert rel_err(got["projected"], want.last_hidden_state.numpy()) < 1e-5


def test_the_assistant_config_is_checked():
    target = _target("dense")[0]
    good = assistant_config(target, [SLIDING, FULL], ordered=True)
    AssistantConfig.from_hf(good)
    for key, value, message in [
        ("hidden_size_per_layer_input", 8, "hidden_size_per_layer_input=8: an assistant has 0"),
        ("enable_moe_block", True, "enable_moe_block=True"),
        ("num_kv_shared_layers", 1, "every assistant layer reads the target's keys"),
    ]:
        bad = dict(good, text_config=dict(good["text_config"], **{key: value}))
        with pytest.raises(ValueError, match=message):
            AssistantConfig.from_hf(bad)
    with pytest.raises(ValueError, match="model_type='gemma4_text': expected a 'gemma4_assis"):
        AssistantConfig.from_hf(dict(good, model_type="gemma4_text"))
    unified = assistant_config(target, [SLIDING, FULL], ordered=False, unified=True)
    unified.pop("backbone_hidden_size")
    text = dict(unified["text_config"])
    text.pop("sliding_window")
    read = AssistantConfig.from_hf(dict(unified, text_config=text))
    assert (read.backbone_hidden_size, read.text.sliding_window) == (3840, 1024)  # its defaults
    bad = dict(unified, text_config=dict(text, num_kv_shared_layers=0))
    with pytest.raises(ValueError, match="num_kv_shared_layers=0: every assistant layer"):
        AssistantConfig.from_hf(bad)  # transformers builds it (k_proj per layer); no drafter
    _, _, ours = _target("dense")
    _, drafter = _assistant(dict(target, hidden_size=40), [SLIDING], ordered=False)
    ids = np.arange(7, 15)[None]
    with pytest.raises(ValueError, match="backbone_hidden_size=40"):
        ours.generate(ids, max_new_tokens=2, assistant=drafter)
    _, drafter = _assistant(target, [SLIDING], ordered=False)
    with pytest.raises(ValueError, match="greedy here"):
        ours.generate(ids, max_new_tokens=2, assistant=drafter, sampling=object())
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        ours.generate(ids, max_new_tokens=2, assistant=drafter, num_speculative_tokens=0)
    with pytest.raises(ValueError, match="without an assistant"):
        ours.generate(ids, max_new_tokens=2, num_speculative_tokens=2)


# (target, drafts, the assistant's layers, centroid head, an image in the prompt, sliding ring)
CASES = [
    ("dense", 1, [SLIDING, FULL], True, True, True),
    ("dense", 3, [FULL], False, False, False),
    ("moe", 7, [SLIDING, SLIDING, FULL], True, True, True),
]


@pytest.mark.parametrize("kind, drafts, layers, ordered, image, ring", CASES)
def test_tokens_equal_the_target_alone_and_transformers(kind, drafts, layers, ordered, image,
                                                        ring):  # fmt: skip
    """Greedy speculative tokens equal transformers' target alone and its
    `generate(assistant_model=)`, the prompt past the sliding window, the cache linear or in
    a ring; the drafts each round proposes are counted."""
    text, hf, ours = _target(kind)
    hf_drafter, drafter = _assistant(text, layers, ordered=ordered, drafts=drafts)
    rng = np.random.default_rng(drafts)
    grids = [(3, 6)] if image else []
    patches = patches_for(grids, rng, 12)
    ids = prompt(rng, 14, [h * w // 9 for h, w in grids], 96)
    want, _ = hf_generate(hf, ids, patches, grids, 12, eos=None)
    with torch.no_grad():
        inputs = dict(input_ids=torch.from_numpy(ids)[None], do_sample=False, pad_token_id=0,
                      eos_token_id=None, max_new_tokens=12)  # fmt: skip
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == 4).long()
        if image:
            from tests.hf_vision import hf_padded_inputs

            inputs["pixel_values"], inputs["image_position_ids"] = hf_padded_inputs(patches, grids)
        theirs = hf.generate(**inputs, assistant_model=hf_drafter)[0, len(ids) :].numpy()
    np.testing.assert_array_equal(theirs, want)
    _assert_speculates(ours, drafter, (ids, patches, grids), want, drafts, ring)


def _assert_speculates(ours, drafter, prompt_, want, drafts, ring):
    """`ours.generate(assistant=drafter)` on (ids [L], patches, grids) gives `want` [N], each
    round proposing `drafts`, fewer rounds than tokens."""
    ids, patches, grids = prompt_
    rounds = []
    got = ours.generate(ids[None], patches, grids, max_new_tokens=len(want), stop=(),
                        assistant=drafter, sliding_ring=ring, rounds=rounds)  # fmt: skip
    np.testing.assert_array_equal(got[0], want)
    assert all(r.proposed == (drafts,) for r in rounds)
    emitted = 1 + sum(r.accepted[0] + 1 for r in rounds)
    assert emitted >= len(want) and len(rounds) < len(want)


@pytest.mark.parametrize("image", [False, True])
def test_unified_tokens_equal_the_target_alone_and_transformers(image):
    """The 12B Unified with its drafter (Gemma4UnifiedAssistantForCausalLM): greedy
    speculative tokens equal transformers' target alone (static cache, the mask `ref`
    follows: docs/codegen.md) and its `generate(assistant_model=)`, text only or with an
    image (2×3 blocks, random pixels in [0, 1]). transformers' assisted decoding refuses a
    static cache (not croppable); its dynamic cache also opens the image's blocks on the full
    layer, which on this prompt changes no token (the first oracle is the one that holds)."""
    from tests.hf_unified import hf_greedy, hf_unified

    if "unified" not in _MODELS:
        hf = hf_unified()
        with tempfile.TemporaryDirectory() as folder:
            hf.save_pretrained(folder)
            _MODELS["unified"] = hf, Gemma4Unified.from_pretrained(folder)
    hf, ours = _MODELS["unified"]
    text = text_config(moe=False, layer_types=[SLIDING, FULL], k_eq_v=True, ple=0)
    hf_drafter, drafter = _assistant(text, [SLIDING, FULL], ordered=image, drafts=2 + image,
                                     unified=True)  # fmt: skip
    rng = np.random.default_rng(11)
    grids = [(2, 3)] if image else []
    patches = [rng.uniform(size=(6, 6912)).astype(np.float32) for _ in grids]
    ids = prompt(rng, 14, [6 for _ in grids], 96)
    inputs = dict(input_ids=torch.from_numpy(ids)[None])
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == 4).long()
    if image:
        xy = np.stack(np.meshgrid(np.arange(3), np.arange(2)), -1).reshape(1, 6, 2)  # (x, y)
        inputs["pixel_values"] = torch.from_numpy(patches[0])[None]
        inputs["image_position_ids"] = torch.from_numpy(xy)
    want, _ = hf_greedy(hf, inputs, 10)
    with torch.no_grad():
        theirs = hf.generate(**inputs, assistant_model=hf_drafter, do_sample=False,
                             pad_token_id=0, eos_token_id=None, max_new_tokens=10)  # fmt: skip
    np.testing.assert_array_equal(theirs[0, len(ids) :].numpy(), want)
    _assert_speculates(ours, drafter, (ids, patches, grids), want, 2 + image, image)


def test_first_drafts_equal_transformers_candidate_generator():
    """After the prompt, transformers' SinglePositionMultiTokenCandidateGenerator and ours draft
    the same K tokens with the same logits, ≤ 1e-5 (both read the prompt's keys alone; later
    rounds part where transformers slices its outputs to the current length,
    docs/codegen.md): the target's hidden state after its final norm, its last non-shared
    layer of each type, every draft at the same position."""
    from transformers.generation.candidate_generator import (
        SinglePositionMultiTokenCandidateGenerator as Generator,
    )

    text, hf, ours = _target("dense")
    hf_drafter, drafter = _assistant(text, [SLIDING, FULL], ordered=True, drafts=4)
    ids = prompt(np.random.default_rng(3), 13, [], 96)
    inputs = torch.from_numpy(ids)[None]
    with torch.no_grad():
        out = hf.model.language_model(input_ids=inputs, output_hidden_states=True,
                                      return_shared_kv_states=True)  # fmt: skip
        first = hf(input_ids=inputs).logits[0, -1].argmax()
        gen = Generator(hf_drafter, hf.get_input_embeddings(), hf.generation_config)
        gen.main_model_max_length = 100
        candidates, logits = gen.get_candidates(torch.cat([inputs, first.view(1, 1)], 1), {},
                                                out, False, 0)  # fmt: skip
    cache = init_cache(ours.config, 1, 32)
    got = step(ours.params, ours.lm_head, cache, ids[None], np.arange(len(ids))[None],
               config=ours.config, last_only=True)  # fmt: skip
    token = np.argmax(got["logits"][:, 0], axis=-1)
    assert int(token[0]) == int(first)
    mine, mine_logits = speculative.draft(ours, drafter, got["cache"], token,
                                          got["hidden"][:, 0], np.array([len(ids)]), 4)  # fmt: skip
    np.testing.assert_array_equal(mine[0], candidates[0, len(ids) + 1 :].numpy())
    assert rel_err(mine_logits, logits.numpy()) < 1e-5  # each step's logits, not only argmax


class _Scripted:
    """A drafter standing in for `speculative.draft`: row r's drafts are the target's own greedy
    continuation (`truth[r]`) with the draft after `agree` correct ones changed, `agree` drawn
    per round and row: every acceptance pattern, full rounds included. Each call also checks
    what a real draft would read (`speculative.drafter_keys`): in each shared layer exactly
    the positions before the draft's (a sliding layer's last W + 1 of them), each holding the
    key and value a plain prefill of the prompt and the truth puts there (`exact`)."""

    def __init__(self, truth, lengths, draw, exact):
        self.truth, self.lengths, self.draw, self.exact = truth, lengths, draw, exact
        self.drawn = []

    def __call__(self, target, assistant, cache, token, hidden, position, count):
        self.check_keys(target.config, cache, position)
        out = np.zeros((len(token), count), np.int32)
        agree = []
        for r, p in enumerate(position):
            done = int(p) - self.lengths[r]  # tokens emitted before the last one
            right = np.resize(self.truth[r][done + 1 : done + 1 + count], count)
            n = self.draw(count)
            out[r] = right
            if n < count:
                out[r, n] = (right[n] + 1) % 96
            agree.append(n)
        self.drawn.append(agree)
        return out, None

    def check_keys(self, config, cache, position):
        layers = shared_layers(config)
        for kind, (k, v, kv_pos, _) in speculative.drafter_keys(config, cache, position).items():
            ref = (self.exact["k"][str(layers[kind])], self.exact["v"][str(layers[kind])])
            for r, p in enumerate(int(x) for x in position):
                first = max(p - config.sliding_window - 1, 0) if kind == SLIDING else 0
                slots = np.flatnonzero(np.asarray(kv_pos[r]) >= first)
                held = np.asarray(kv_pos[r])[slots]
                assert sorted(held.tolist()) == list(range(first, p)), (kind, r, p, held)
                for mine, want in zip((k, v), ref, strict=True):
                    got = np.asarray(mine)[r][:, slots]
                    # float32: a chunk's keys and a whole prefill's differ by ~1e-5
                    np.testing.assert_allclose(got, np.asarray(want)[r][:, held], atol=1e-4)


def _exact_cache(model, rows, truth):
    """The cache of one plain prefill of each row's prompt and its greedy continuation."""
    full = [np.concatenate([r, t]) for r, t in zip(rows, truth, strict=True)]
    width = max(map(len, full))
    ids = np.zeros((len(full), width), np.int64)
    positions = np.full((len(full), width), -1, np.int32)
    for i, f in enumerate(full):
        ids[i, : len(f)], positions[i, : len(f)] = f, np.arange(len(f))
    cache = init_cache(model.config, len(full), width)
    return step(model.params, model.lm_head, cache, ids, positions, config=model.config)["cache"]


@settings(max_examples=examples(2), deadline=None)
@given(data=st.data(), drafts=st.sampled_from([1, 3, 7]), ring=st.booleans(),
       stop_at=st.integers(-1, 10))  # fmt: skip
def test_any_acceptance_pattern_gives_the_targets_tokens(data, drafts, ring, stop_at):
    """Drawn acceptance patterns per round and row (batch 2, prompts past the window, the
    sliding ring of W + K + 1 slots or linear): the tokens are the target's plain greedy ones,
    each round's accepted count is the pattern's, a stop id met inside the accepted drafts
    ends the row there, and every draft reads the accepted tokens' keys, where the cache holds
    them (no rejected key in their place, none evicted)."""
    _, _, ours = _target("dense")
    rng = np.random.default_rng(drafts)
    rows = [prompt(rng, n, [], 96) for n in (9, 13)]
    padded = np.zeros((2, 13), np.int64)
    for i, r in enumerate(rows):
        padded[i, : len(r)] = r
    lengths = [len(r) for r in rows]
    truth = ours.generate(padded, max_new_tokens=24, lengths=lengths, stop=())
    stop = () if stop_at < 0 else (int(truth[0, stop_at]),)
    want = ours.generate(padded, max_new_tokens=12, lengths=lengths, stop=stop, sliding_ring=ring)
    agree = lambda k: data.draw(st.integers(0, k), label="agree")  # noqa: E731
    script = _Scripted(truth, lengths, agree, _exact_cache(ours, rows, truth))
    _, drafter = _assistant(_target("dense")[0], [SLIDING], ordered=False)
    rounds = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(speculative, "draft", script)
        got = ours.generate(padded, max_new_tokens=12, lengths=lengths, stop=stop,
                            assistant=drafter, num_speculative_tokens=drafts, sliding_ring=ring,
                            rounds=rounds)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    for r, agreed in zip(rounds, script.drawn, strict=True):
        for row in range(2):
            if r.proposed[row]:
                assert r.accepted[row] == agreed[row]


@settings(max_examples=examples(2), deadline=None)
@given(drafts=st.sampled_from([1, 3]), ring=st.booleans(), slots_only=st.booleans(),
       slotted=st.booleans(), data=st.data())  # fmt: skip
def test_a_device_round_equals_the_host_round(drafts, ring, slots_only, slotted, data):
    """`device_round` (the target's step, the acceptance and the next drafts in one call)
    against the host's pieces on the same state: `accepted` and `emitted` on the step's logits,
    `draft` from the target's hidden state at the last accepted position; drafts drawn as the
    target's continuation changed after a drawn count; batch 2, prompts past the window; the
    cache recorded or slots only (as QAIC holds it); `slotted`: the rows in drawn slots of a
    3-slot continuous-batching cache (`batch_index`) and a compute context length (`key_len`)
    below ctx_len: the same results."""
    _, _, ours = _target("dense")
    _, drafter = _assistant(_target("dense")[0], [SLIDING, FULL], ordered=True, drafts=drafts)
    rng = np.random.default_rng(drafts)
    rows = [prompt(rng, n, [], 96) for n in (9, 13)]
    lengths = np.array([len(r) for r in rows])
    # the first K + 1 tokens are used: 12 for every K drawn, as the tests around generate them
    # on these prompt lengths (the same shapes: their programs, not new ones per K)
    truth = ours.generate(_padded(rows), max_new_tokens=12, lengths=lengths, stop=())
    cache = init_cache(ours.config, 2, 32, ring=ring, drafts=drafts, slots_only=slots_only)
    prefill = step(ours.params, ours.lm_head, cache, _padded(rows), _positions(rows),
                   config=ours.config, last_only=True)  # fmt: skip
    ids = truth[:, : drafts + 1].astype(np.int32).copy()
    for r in range(2):
        n = data.draw(st.integers(0, drafts), label=f"agree {r}")
        if n < drafts:
            ids[r, n + 1] = (ids[r, n + 1] + 1) % 96
    positions = lengths[:, None].astype(np.int32) + np.arange(drafts + 1, dtype=np.int32)
    held, extra = prefill["cache"], {}
    if slotted:
        slots = np.array(data.draw(st.permutations([0, 1, 2]), label="slots")[:2], np.int32)
        held = put_rows(init_cache(ours.config, 3, 32, ring=ring, drafts=drafts,
                                   slots_only=slots_only), held, slots)  # fmt: skip
        extra = {"batch_index": slots[:, None], "key_len": 24}
    got = jitted(
        speculative.device_round,
        ours.params,
        ours.lm_head,
        drafter.params,
        held,
        ids,
        positions,
        config=ours.config,
        assistant=drafter.config,
        **extra,
    )
    out = step(ours.params, ours.lm_head, prefill["cache"], ids, positions, config=ours.config)
    chosen = np.asarray(np.argmax(out["logits"], axis=-1))
    n = speculative.accepted(ids[:, 1:], chosen)
    np.testing.assert_array_equal(got["accepted"], n)
    for row, want in zip(np.asarray(got["tokens"]), speculative.emitted(ids[:, 1:], chosen, n),
                         strict=True):  # fmt: skip
        np.testing.assert_array_equal(row[: len(want)], want)
        assert (row[len(want) :] == -1).all()
    every = np.arange(2)
    host, _ = speculative.draft(ours, drafter, out["cache"], chosen[every, n],
                                out["hidden"][every, n], lengths + n + 1, drafts)  # fmt: skip
    np.testing.assert_array_equal(got["drafts"], host)


def _padded(rows):
    out = np.zeros((len(rows), max(map(len, rows))), np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def _positions(rows):
    out = np.full((len(rows), max(map(len, rows))), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = np.arange(len(r))
    return out


def test_device_rounds_give_the_targets_tokens():
    """`device_generate` (each round one `device_round` call, the first verifying pad-id
    drafts) gives plain greedy decoding's tokens, batch 2 with a stop id, in a sliding ring."""
    _, _, ours = _target("dense")
    _, drafter = _assistant(_target("dense")[0], [SLIDING, FULL], ordered=False, drafts=3)
    rng = np.random.default_rng(4)
    rows = [prompt(rng, n, [], 96) for n in (9, 13)]
    lengths = [len(r) for r in rows]
    free = ours.generate(_padded(rows), max_new_tokens=12, lengths=lengths, stop=())
    stop = (int(free[0, 6]),)
    want = ours.generate(_padded(rows), max_new_tokens=12, lengths=lengths, stop=stop)
    cache = init_cache(ours.config, 2, 12 + 13 + 3, ring=True, drafts=3)
    prefill = step(ours.params, ours.lm_head, cache, _padded(rows), _positions(rows),
                   config=ours.config, last_only=True)  # fmt: skip
    rounds = []
    got = speculative.device_generate(ours, drafter, (prefill["cache"], prefill["logits"][:, 0]),
                                      lengths, 12, 3, stop, 0, rounds)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert rounds and all(r.proposed[0] in (0, 3) for r in rounds)
