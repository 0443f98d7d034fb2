"""Speculative decoding over exported graphs (`export --assistant`): the speculate graph (a
round in one call: verify K drafts, accept, draft the next K) checked by verify against `ref`
(tokens exactly), and `run` and `serve` giving transformers' greedy tokens of the target alone,
with images, stop ids inside a round, continuous batching, a MoE target, a blocked decode and
compute context lengths; the drafter a `repeating_assistant`, so rounds accept every count."""

import json
import os
import re

import blake3
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from codegen.__main__ import main
from codegen.check import head_slices, segments
from codegen.check.verify import verify
from codegen.export.command import ExportError, ExportOptions, export
from codegen.folder.integrity import FolderError
from codegen.folder.manifest import load as load_manifest
from codegen.folder.sessions import read_manifest
from codegen.graphs import GraphError
from codegen.run.runtime import RunError, Runner
from codegen.run.speculation import round_feed
from tests.assistant_oracle import assistant_config, hf_assistant, repeating_assistant
from tests.e2e.test_serve import GRIDS, MARGIN, REQUESTS, check_serve
from tests.text_oracle import hf_generate, hf_model, hf_request, prompt, text_config
from tests.util import examples, folder_copy

SLIDING, FULL = "sliding_attention", "full_attention"
OPTIONS = dict(budgets=(70,), batch_size=2, seq_len=12, hash_shards=False)
FIXTURES = [HealthCheck.function_scoped_fixture]


def _saved(tmp_path_factory, name, text, seed, drafts=None):
    """(transformers target, its folder, the repeating assistant's folder)."""
    hf = hf_model(text, seed)
    target = tmp_path_factory.mktemp(f"{name}-target")
    hf.save_pretrained(target)
    table = hf.state_dict()["model.language_model.embed_tokens.weight"]
    assistant = repeating_assistant(text, table, [SLIDING, FULL])
    assistant.generation_config.num_assistant_tokens = drafts
    folder = tmp_path_factory.mktemp(f"{name}-assistant")
    assistant.save_pretrained(folder)
    return hf, target, folder


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(transformers target, Runner) over an export of a dense VLM target (attention_k_eq_v)
    with its assistant: batch 2, K = 3 from the assistant's generation_config; the shards
    hashed (the Runner checks them)."""
    text = text_config(moe=False, layer_types=[SLIDING, SLIDING, FULL], k_eq_v=True, ple=8,
                       window=5)  # fmt: skip
    hf, target, assistant = _saved(tmp_path_factory, "dense", text, 7, drafts=3)
    out = tmp_path_factory.mktemp("dense-export") / "out"
    export(ExportOptions(out=out, model=target, assistant=assistant, ctx_len=96,
                         **dict(OPTIONS, hash_shards=True)), log=print)  # fmt: skip
    return hf, Runner(out)


@pytest.fixture(scope="module")
def slotted(tmp_path_factory):
    """(transformers target, Runner) over a continuous-batching export (3 slots) of a MoE
    target with KV sharing, K = 7, decode blocked over KV (2 blocks) with compute context
    lengths."""
    text = text_config(moe=True, layer_types=[SLIDING, FULL] * 2, shared=2, ple=8, window=5)
    hf, target, assistant = _saved(tmp_path_factory, "moe", text, 11)
    out = tmp_path_factory.mktemp("moe-export") / "out"
    options = dict(OPTIONS, full_batch_size=3, ctx_len=96, num_speculative_tokens=7,
                   decode_blocking=("kv", {"num_kv_blocks": 2}),
                   comp_ctx_lengths_decode=(48,))  # fmt: skip
    export(ExportOptions(out=out, model=target, assistant=assistant, **options), log=print)
    return hf, Runner(out)


def test_verify_checks_the_speculate_graph(dense, slotted, monkeypatch):
    """The speculate graph against `device_round` on drawn inputs, layer by layer: tokens,
    counts and drafts exactly, caches within verify's tolerance; each export's manifest
    records the assistant, its shards under assistant/, K and the ring of W + K + 1 slots."""
    # the dense export's speculate graph layer by layer: each layer call of both models (the
    # drafter's K times) against its own ONNX function, the rest in the glue; the other
    # graphs as every export's (tests/codegen/export); the slotted export's speculate graph
    # (MoE, blocked, compute context lengths) by its tokens (`test_serve_speculates_each_slot`)
    # the heads read 32 rows at a time, as a released vocabulary is: a glue segment that
    # projects onto one and reads the projection whole is cut at the logits (`head_cut`), its
    # first part run a slice at a time
    monkeypatch.setattr(head_slices, "VOCAB_ROWS", 32)
    cuts = []
    monkeypatch.setattr(segments.Runner, "_in_parts", _counted(segments.Runner._in_parts, cuts))
    rows = verify(dense[1].folder, seed=3, check_shards=False, graphs=["speculate"],
                  layerwise_given=True)  # fmt: skip
    # cut at the logits: after the target's last layer (its head), after each of the K = 3
    # draft steps' last layer (the drafter's own head)
    assert len(cuts) == 1 + 3, cuts
    assert {r[2] for r in rows} >= {"tokens", "accepted", "drafts", "layer outputs"}
    assert all(r[-1] for r in rows), rows
    for _, runner in (dense, slotted):
        manifest = read_manifest(runner.folder)
        assert manifest.assistant and any(s.file.startswith("assistant/") for s in manifest.shards)
        graph = next(g for g in manifest.graphs if g.kind == "speculate")
        k = graph.options["drafts"]
        assert graph.inputs[0].shapes[graph.specializations[0]["name"]][1] == k + 1
        ring = manifest.retained_layout["past_key.0"][2]
        assert ring == 5 + k + 1, (ring, k)
    assert dense[1].drafts == 3 and slotted[1].drafts == 7
    script = slotted[1].folder + "/compile.sh"
    assert "-m=speculate.onnx" in open(script).read()


def _counted(method, calls):
    """`method` that also appends its arguments to `calls`."""

    def counted(*args):
        calls.append(args)
        return method(*args)

    return counted


@settings(max_examples=examples(2), deadline=None, suppress_health_check=FIXTURES)
@given(lengths=st.lists(st.integers(3, 14), min_size=2, max_size=2), data=st.data(),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_speculative_run_gives_transformers_tokens(dense, lengths, data, seed):
    """A batch of two prompts with drawn images and a stop id drawn from inside the target's
    continuation (so a row may stop inside a round): the speculating runner gives each row
    transformers' greedy tokens for it alone, as the runner without speculation does."""
    hf, runner = dense
    rng = np.random.default_rng(seed)
    new = data.draw(st.integers(4, 14), label="max_new_tokens")
    rows, images, free = [], [], []
    for length in lengths:
        grids = data.draw(st.lists(st.sampled_from(GRIDS), max_size=1), label="grids")
        ids, patches, tokens, gap = hf_request(hf, rng, length, grids, new, eos=None)
        assume(gap > MARGIN)
        rows.append(ids)
        images += list(zip(patches, grids, strict=True))
        free.append((ids, patches, grids, tokens))
    stop = int(free[0][3][data.draw(st.integers(1, new - 1), label="stop at")])
    want = [hf_generate(hf, i, p, g, new, eos=stop)[0] for i, p, g, _ in free]
    lines = []
    got = runner.generate(rows, images, max_new_tokens=new, stop=(stop,), log=lines.append)
    plain = Runner(runner.folder, check_shards=False, speculate=False)
    assert plain.drafts == 0
    again = plain.generate(rows, images, max_new_tokens=new, stop=(stop,))
    for r, w in enumerate(want):
        np.testing.assert_array_equal(got[r, : len(w)], w, err_msg="\n".join(lines))
        np.testing.assert_array_equal(again[r, : len(w)], w)
    assert any(line.startswith("row 0 speculation:") for line in lines)


def test_the_assistants_shards_are_hashed_beside_the_targets(dense):
    shards = load_manifest(dense[1].folder).shards
    assert {s.file.startswith("assistant/") for s in shards} == {True, False}
    for s in shards:  # small plain files: BLAKE3 of the bytes read
        raw = open(os.path.join(dense[1].folder, s.file), "rb").read()
        assert s.digest == ("blake3", blake3.blake3(raw).hexdigest()), s.file


def test_rounds_accept_every_count_and_report_it(dense, capsys):
    """A prompt whose greedy continuation repeats tokens in runs: the repeating drafter's rounds
    accept every count from 0 to 3 (rejected drafts past the sliding window: a ring of W slots
    instead of W + K + 1 gives other tokens here), the run prints per row its rounds, drafts
    accepted per round and target calls per token (fewer than 1), and `--no-speculate` prints
    the same ids."""
    hf, runner = dense
    ids = prompt(np.random.default_rng(4), 14, [], 96)
    want, _ = hf_generate(hf, ids, [], [], 20, eos=None)
    args = ["run", runner.folder, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens",
            "20", "--ignore-eos", "--skip-shard-check", "--greedy"]  # fmt: skip
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
    counts = [int(x) for x in re.findall(r"accepted \[(\d+)\] of 3", err)]
    assert {0, 1, 2, 3} <= set(counts[1:]), err
    line = re.search(r"row 0 speculation: (\d+) rounds, ([\d.]+) of 3 .* ([\d.]+) target calls "
                     r"per token", err)  # fmt: skip
    assert line and int(line[1]) == len(counts) and float(line[3]) < 1, err
    assert abs(float(line[2]) - np.mean(counts)) < 0.01
    assert main([*args, "--no-speculate"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
    assert "decode step" in err and "speculation" not in err


@settings(max_examples=examples(1), deadline=None, suppress_health_check=FIXTURES)
@given(**REQUESTS)
def test_serve_speculates_each_slot(slotted, lengths, data, seed):
    """Continuous batching with speculation (K = 7, a MoE target, a blocked decode, compute
    context lengths): requests join and leave slots while every slot's round runs in one call,
    and each gets transformers' tokens for it alone."""
    check_serve(*slotted, lengths, data, seed, calls="speculate")


def test_what_cannot_speculate_is_refused(dense, tmp_path):
    """By name: K without an assistant, K < 1, weights as inputs, an assistant for another
    target (its vocabulary), and an assistant shard changed after export."""
    _, runner = dense
    folder = runner.folder
    base = dict(out=tmp_path / "x", model=folder, budgets=())
    with pytest.raises(ExportError, match="give --assistant"):
        export(ExportOptions(num_speculative_tokens=3, **base))
    with pytest.raises(ExportError, match="expected an int >= 1"):
        export(ExportOptions(assistant=folder + "/assistant", num_speculative_tokens=0, **base))
    with pytest.raises(ExportError, match="--graphs model"):
        export(ExportOptions(assistant=folder + "/assistant", graphs=("attention",), **base))
    with pytest.raises(ExportError, match="--weights inputs"):
        export(ExportOptions(assistant=folder + "/assistant", weights="inputs", **base))
    text = text_config(moe=False, layer_types=[SLIDING, FULL], window=5)
    other = hf_assistant(assistant_config(dict(text, vocab_size=128), [FULL], ordered=False), 1)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(GraphError, match="vocab_size=128"):
        export(ExportOptions(assistant=tmp_path / "other", **base))
    copy = folder_copy(folder, tmp_path)
    with open(copy / "assistant" / "model.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(FolderError, match="assistant/model.safetensors"):
        Runner(copy)
    assert json.loads((copy / "manifest.json").read_text())["assistant"]


def test_a_round_at_the_end_of_the_cache_pads_past_it():
    """`round_feed`: a round's draft positions at or past ctx_len are padding (−1: the cache has
    no slot there; onnxruntime lets such a write pass, a device would write out of bounds), as
    is a row without a request and the rows past the given ones."""
    ids, pos = round_feed(np.array([7, 8]), np.array([94, -1]), np.array([[1, 2, 3], [4, 5, 6]]),
                          3, 96)  # fmt: skip
    np.testing.assert_array_equal(pos, [[94, 95, -1, -1], [-1] * 4, [-1] * 4])
    np.testing.assert_array_equal(ids[:2], [[7, 1, 2, 3], [8, 4, 5, 6]])


def test_a_prefill_side_hands_its_cache_to_a_speculating_decode_side(dense, tmp_path):
    """`--prefill-only --assistant` sizes the ring for K (here 1; no speculate graph),
    `--decode-only --assistant` holds decode and speculate: `run --decode-from` speculates on
    the handed-over cache and gives the target's tokens; a prefill side without the assistant
    is refused by its ring."""
    hf, runner = dense
    folder, sides = runner.folder, {}
    for phase in ("prefill", "decode"):
        sides[phase] = tmp_path / phase
        export(ExportOptions(out=sides[phase], model=folder, assistant=folder + "/assistant",
                             num_speculative_tokens=1, phases=(phase,), budgets=(), batch_size=2,
                             seq_len=12, ctx_len=96, hash_shards=False))  # fmt: skip
    kinds = {p: [g.kind for g in read_manifest(sides[p]).graphs] for p in sides}
    assert kinds == {"prefill": ["prefill"], "decode": ["decode", "speculate"]}
    ids = prompt(np.random.default_rng(4), 14, [], 96)
    want, _ = hf_generate(hf, ids, [], [], 12, eos=None)
    handed = Runner(sides["prefill"], decode_folder=sides["decode"], check_shards=False)
    assert handed.drafts == 1
    np.testing.assert_array_equal(handed.generate([ids], max_new_tokens=12, stop=())[0], want)
    export(ExportOptions(out=tmp_path / "plain", model=folder, phases=("prefill",), budgets=(),
                         batch_size=2, seq_len=12, ctx_len=96, hash_shards=False))  # fmt: skip
    with pytest.raises(RunError, match="sliding ring"):
        Runner(tmp_path / "plain", decode_folder=sides["decode"])
