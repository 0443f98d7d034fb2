"""Continuous batching over exported graphs (`--full-batch-size`): requests with images and
their own lengths join free slots mid-decode, prefill (two at a time) into their slots with
`batch_index`, decode together over every slot in onnxruntime, and leave at their own length.
Each request's tokens equal transformers' `generate` on that request alone."""

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from codegen.__main__ import main
from codegen.check.verify import verify
from codegen.export.command import ExportOptions, export
from codegen.run.runtime import Request, RunError, Runner
from tests.hf_vision import patches_for
from tests.text_oracle import hf_generate, hf_model, hf_request, prompt, text_config
from tests.util import examples

SLOTS, BATCH = 3, 2
MARGIN = 1e-4
GRIDS = [(3, 3), (6, 6), (6, 9)]


OPTIONS = dict(budgets=(70,), batch_size=BATCH, seq_len=12, ctx_len=96, hash_shards=False)


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """(transformers model, its checkpoint folder): a dense VLM with per-layer embeddings and
    KV sharing."""
    layers = ["sliding_attention", "full_attention"] * 2
    hf = hf_model(text_config(moe=False, layer_types=layers, shared=2, ple=8, window=5), 17)
    folder = tmp_path_factory.mktemp("cb-model")
    hf.save_pretrained(folder)
    return hf, folder


@pytest.fixture(scope="module")
def served(hf_saved, tmp_path_factory):
    """(transformers model, Runner) over a continuous-batching export of `hf_saved`."""
    hf, folder = hf_saved
    out = tmp_path_factory.mktemp("cb-export") / "out"
    export(ExportOptions(out=out, model=folder, full_batch_size=SLOTS, **OPTIONS), log=print)
    return hf, Runner(out)


# a few requests' prompt lengths, what else each holds (drawn from data), and a seed
REQUESTS = dict(
    lengths=st.lists(st.integers(3, 20), min_size=6, max_size=7),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
FIXTURES = [HealthCheck.function_scoped_fixture]


@settings(max_examples=examples(2), suppress_health_check=FIXTURES)
@given(**REQUESTS)
def test_each_request_gets_transformers_tokens(served, lengths, data, seed):
    check_serve(*served, lengths, data, seed)


@pytest.fixture(scope="module", params=["kv_batch_fold", "kv_headpar:batch_fold=true"])
def folded_served(hf_saved, tmp_path_factory, request):
    """(transformers model, Runner) over a continuous-batching export of `hf_saved` whose
    decode folds the batch into the KV heads (QEfficient's batch fold, plain and
    head-parallel), checked in onnxruntime as it is exported."""
    hf, folder = hf_saved
    out = tmp_path_factory.mktemp("cb-folded") / "out"
    mode, _, extra = request.param.partition(":")
    blocking = (mode, {"num_kv_blocks": 3, **({"batch_fold": True} if extra else {})})
    options = dict(full_batch_size=SLOTS, decode_blocking=blocking, **OPTIONS)
    export(ExportOptions(out=out, model=folder, **options), log=print)
    return hf, Runner(out)


@settings(max_examples=examples(1), suppress_health_check=FIXTURES)
@given(**REQUESTS)
def test_batch_folded_decode_serves_transformers_tokens(folded_served, lengths, data, seed):
    """Every cache is [1, SLOTS·Hkv, T, D] in both graphs (the manifest's retained layout),
    prefill writes its slot's rows inside it, and requests joining and leaving get
    transformers' tokens."""
    hf, runner = folded_served
    manifest = json.loads((Path(runner.folder) / "manifest.json").read_text())
    heads = hf.config.text_config.num_key_value_heads
    assert manifest["retained_layout"]["past_key.0"][:2] == [1, SLOTS * heads]
    assert all(g["options"]["folded_cache"] for g in manifest["graphs"] if g["kind"] != "vision")
    check_serve(hf, runner, lengths, data, seed)
    # layer by layer too: each folded cache drawn at its layer, compared there
    rows = verify(runner.folder, seed=5, check_shards=False, layerwise_given=True)
    assert rows and all(r[-1] for r in rows), rows


def check_serve(hf, runner, lengths, data, seed, calls="decode"):
    """Requests of `lengths` tokens (images, new tokens and arrivals drawn from `data`) served
    by `runner`: each gets transformers' tokens for it alone; one joins mid-decode (a step of
    `calls`: "decode", or "speculate" rounds)."""
    rng = np.random.default_rng(seed)
    requests, want = [], []
    for length in lengths:
        grids = data.draw(st.lists(st.sampled_from(GRIDS), max_size=2))
        new = data.draw(st.integers(2, 8))
        arrival = data.draw(st.integers(0, 8))
        ids, patches, tokens, gap = hf_request(hf, rng, length, grids, new)
        assume(gap > MARGIN)
        requests.append(Request(ids, list(zip(patches, grids, strict=True)), new, arrival))
        want.append(tokens)
    got, timeline = runner.serve(requests)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"request {i}\n" + "\n".join(timeline))
    assert any("joins" in line and calls in line for line in timeline)


def test_serve_command_reads_requests(served, tmp_path, capsys):
    hf, runner = served
    rng = np.random.default_rng(4)
    patches = patches_for([(6, 6)], rng, 12)
    np.save(tmp_path / "a.npy", patches[0])
    ids = prompt(rng, 6, [4], 96)
    lines = [
        {"prompt_ids": ids.tolist(), "patches": ["a.npy"], "grids": [[6, 6]], "max_new_tokens": 4},
        {"prompt_ids": [9, 10, 11], "max_new_tokens": 3, "arrival": 2},
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    assert main(["serve", runner.folder, "--requests", str(path), "--greedy"]) == 0
    out, err = capsys.readouterr()
    want, _ = hf_generate(hf, ids, patches, [(6, 6)], 4)
    assert out.splitlines()[0] == "request 0: " + ",".join(str(int(t)) for t in want)
    assert "step 2: request 1 joins slot" in err


def test_serve_refuses_bad_requests(served):
    hf, runner = served
    assert runner.slots == SLOTS
    with pytest.raises(RunError, match="request 0: token id 96"):
        runner.serve([Request(np.array([9, 96]), [], 2)])


def test_partition_config_is_qeffs(served, tmp_path):
    """--num-devices N writes the tensor-slicing config QEfficient writes for
    mdp_ts_num_devices=N (as mdp_ts_N.json, indent 4) and hands it to every compile."""
    _, runner = served
    out = tmp_path / "mdp"
    export(
        ExportOptions(
            out=out, model=runner.folder, budgets=(70,), num_devices=4, num_cores=14, verify=False
        ),
        log=print,
    )
    qeff = {
        "connections": [{"devices": [0, 1, 2, 3], "type": "p2p"}],
        "partitions": [
            {
                "name": "Partition0",
                "devices": [
                    {"deviceId": 0, "numCores": 14},
                    {"deviceId": 1, "numCores": 14},
                    {"deviceId": 2, "numCores": 14},
                    {"deviceId": 3, "numCores": 14},
                ],
            }
        ],
    }
    assert (out / "mdp_ts_4.json").read_text() == json.dumps(qeff, indent=4)
    lines = [x for x in (out / "compile.sh").read_text().splitlines() if "qaic-compile" in x]
    assert len(lines) == 2 and all("-mdp-load-partition-config=mdp_ts_4.json" in x for x in lines)


def test_prefill_only_hands_its_cache_to_decode_only(served, tmp_path):
    """Disaggregated serving: a --prefill-only export (vision + prefill) and a --decode-only
    export share the retained-state layout in their manifests; the prefill side's cache,
    handed to the decode side's graph, gives transformers' tokens."""
    hf, runner = served
    sides = {}
    for side, phases in (("prefill", ("prefill",)), ("decode", ("decode",))):
        sides[side] = tmp_path / side
        options = dict(budgets=(70,), seq_len=12, ctx_len=96, phases=phases)
        export(ExportOptions(out=sides[side], model=runner.folder, **options), log=print)
    manifests = {k: json.loads((v / "manifest.json").read_text()) for k, v in sides.items()}
    assert [g["kind"] for g in manifests["prefill"]["graphs"]] == ["vision", "prefill"]
    assert [g["kind"] for g in manifests["decode"]["graphs"]] == ["decode"]
    assert manifests["prefill"]["retained_layout"] == manifests["decode"]["retained_layout"]
    rng = np.random.default_rng(8)
    patches = patches_for([(6, 9)], rng, 12)
    ids = prompt(rng, 15, [6], 96)
    want, _ = hf_generate(hf, ids, patches, [(6, 9)], 6)
    handoff = Runner(sides["prefill"], decode_folder=sides["decode"])
    got = handoff.generate([ids], [(patches[0], (6, 9))], max_new_tokens=6)
    np.testing.assert_array_equal(got[0], want)
    with pytest.raises(RunError, match="no decode graph"):
        Runner(sides["prefill"])
    other = tmp_path / "decode-112"
    options = dict(budgets=(70,), ctx_len=112, phases=("decode",))
    export(ExportOptions(out=other, model=runner.folder, **options), log=print)
    with pytest.raises(RunError, match="KV-cache layout"):
        Runner(sides["prefill"], decode_folder=other)


def test_serve_stops_at_a_stop_id_and_hands_the_slot_over(served, capsys):
    """A stop id the model emits mid-generation: each request ends at its first one (kept),
    as transformers ends it alone, and the request waiting for a slot joins at the step after
    the first to stop; without stop ids every request runs to its limit."""
    hf, runner = served
    assert runner.stop == (1,)  # save_pretrained's generation_config.json: Gemma 4's <eos>
    rng = np.random.default_rng(12)
    rows = [prompt(rng, n, [], 96) for n in (7, 9, 11, 5)]
    free, _ = hf_generate(hf, rows[0], [], [], 8, eos=None)
    stop = int(free[2])
    want = [hf_generate(hf, r, [], [], 8, eos=stop)[0] for r in rows]
    assert len(want[0]) <= 3 and want[0][-1] == stop
    requests = [Request(r, [], 8) for r in rows]  # 3 slots: request 3 waits
    got, timeline = runner.serve(requests, stop=(stop,))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"request {i}\n" + "\n".join(timeline))
    # request i holds slot i; a joining request gets its prefill's token and one decode step's,
    # so its last token comes at step len − 2 (0 for one token), and the slot is free after it
    ends = [max(len(w) - 1, 1) for w in want[:3]]
    first = min(range(3), key=lambda i: (ends[i], i))
    step = ends[first]
    assert timeline[step].startswith(f"step {step}: request 3 joins slot {first}"), timeline
    never, _ = runner.serve(requests, stop=())
    assert [len(t) for t in never] == [8] * 4
    # the command line: --eos-id, two rows padded after the stop id, printed without the padding
    args = ["run", runner.folder, "--prompt-ids", ",".join(map(str, rows[0]))]
    args += ["--prompt-ids", ",".join(map(str, rows[1])), "--max-new-tokens", "8"]
    assert main([*args, "--eos-id", str(stop), "--quiet", "--greedy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [",".join(str(int(t)) for t in w) for w in want[:2]]


def test_sampled_rows_draw_as_their_rows_do_without_slots(served):
    """`generate` over slots draws row i with row i's generator, as an export without slots
    does: two equal prompts sample differently, and row 0 is what the request alone draws."""
    from ref.gemma4.decoding import Sampling

    _, runner = served
    ids = prompt(np.random.default_rng(6), 7, [], 96)
    hot = Sampling(temperature=5.0, top_k=0, top_p=1.0, seed=3)
    rows = runner.generate([ids, ids], max_new_tokens=6, stop=(), sampling=hot)
    assert (rows[0] != rows[1]).any()
    alone, _ = runner.serve([Request(ids, [], 6, sampling=hot)], stop=())
    np.testing.assert_array_equal(rows[0], alone[0])


def test_one_program_moves_no_kv_byte(served, capsys):
    """The device's rules (`codegen.run.device`): with requests arriving mid-decode over 3
    slots, one language program moves no KV byte; every call moves ids, positions, soft tokens
    and logits only. `serve --stats` prints the table."""
    _, runner = served
    assert runner.programs["prefill"] is runner.programs["decode"]
    _check_transfers(runner, True, capsys)


def test_two_programs_hand_the_kv_over_whole_at_each_switch(folded_served, capsys):
    """Where prefill and decode are two programs (a batch-folded decode), the cache crosses
    the host only when the other program reads it next: whole, once out and once in."""
    _, runner = folded_served
    assert runner.programs["prefill"] is not runner.programs["decode"]
    _check_transfers(runner, False, capsys)


def _check_transfers(runner, one, capsys):
    """Serve requests arriving mid-decode; KV crosses in handoffs only (none in one program),
    logits as each decode step's; `serve --stats` prints the table."""
    rng = np.random.default_rng(21)
    requests = [Request(prompt(rng, n, [], 96), [], 5, arrival=a)
                for n, a in ((6, 0), (9, 0), (4, 2), (7, 3), (5, 3))]  # fmt: skip
    order = []
    runner.on_call = lambda kind, feed: order.append(kind)
    runner.transfers.moved.clear()
    runner.transfers.calls.clear()
    try:
        runner.serve(requests, stop=())
    finally:
        runner.on_call = lambda kind, feed: None
    moved = runner.transfers.moved
    switches = sum(a != b for a, b in zip(order, order[1:], strict=False))
    assert switches > 2, order
    state = runner.programs["decode"].state
    whole = sum(x.size for x in state.values()) * 2  # float16 KV (custom_io.yaml)
    handoffs = {c: n for c, n in runner.transfers.calls.items() if c.startswith("handoff")}
    assert sum(handoffs.values()) == (0 if one else switches), (order, handoffs)
    assert {c for (c, _, w) in moved if w == "kv"} == set(handoffs)
    assert runner.transfers.total("kv", "in") == runner.transfers.total("kv", "out")
    assert runner.transfers.total("kv", "out") == (0 if one else switches * whole)
    logits = runner.text.vocab_size * 4
    assert moved[("decode", "out", "logits")] == runner.transfers.calls["decode"] * SLOTS * logits
    path = Path(runner.folder).parent / "device-rules.jsonl"
    path.write_text("\n".join(json.dumps({"prompt_ids": [int(t) for t in r.ids],
                                          "max_new_tokens": 3, "arrival": r.arrival})
                              for r in requests[:3]))  # fmt: skip
    assert main(["serve", str(runner.folder), "--requests", str(path), "--stats"]) == 0
    err = capsys.readouterr().err
    assert "bytes between host and device:" in err and "per generated token" in err, err
    assert ("handoff decode→prefill" in err) != one, err


def test_a_program_refuses_what_the_device_would(served):
    """A program runs only at its specializations' shapes (the message names them), and its
    retained state is its own: fed as a call's input, it is refused."""
    _, runner = served
    decode = runner.programs["decode"]
    feed = {"input_ids": np.zeros((SLOTS - 1, 1), np.int32),
            "position_ids": np.zeros((SLOTS - 1, 1), np.int32),
            "batch_index": np.zeros((SLOTS - 1, 1), np.int32)}  # fmt: skip
    with pytest.raises(RunError, match=r"no specialization takes .*input_ids': \(2, 1\).*"
                       r"it has .*decode: .*input_ids': \(3, 1\)"):  # fmt: skip
        decode.run("decode", feed)
    name = next(iter(decode.retained))
    feed = {k: np.zeros((SLOTS, 1), np.int32) for k in feed} | {name: decode.state[name]}
    with pytest.raises(RunError, match=f"{name} is retained state, held on the device"):
        decode.run("decode", feed)
    with pytest.raises(RunError, match="the whole buffers"):
        decode.write_state("handoff", {name: decode.state[name]})


def test_suppressed_ids_are_never_chosen_as_transformers_suppresses_them(served, tmp_path):
    """generation_config.json's suppress_tokens (every step) and begin_suppress_tokens (the
    first generated token), as the 12B-it sets them, with ids the model would otherwise emit:
    `run`'s generate, `serve` and `ref`'s `Gemma4.generate` give transformers' `generate`
    tokens with them suppressed; sampled rows never draw them."""
    from ref.gemma4 import Gemma4
    from ref.gemma4.decoding import Sampling
    from tests.hf_vision import tree_of
    from tests.text_oracle import top2_gap
    from tests.util import folder_copy

    hf, runner = served
    ids = prompt(np.random.default_rng(31), 9, [], 96)
    free, _ = hf_generate(hf, ids, [], [], 8, eos=None)
    first = [int(free[0])]
    every = sorted({int(t) for t in free[2:6]} - set(first))
    assert every, free
    given = {"suppress_tokens": every, "begin_suppress_tokens": first}
    want, logits = hf_generate(hf, ids, [], [], 8, eos=None, **given)
    assert not np.isin(want, every).any() and want[0] not in first, (free, want)
    masked = logits.copy()
    masked[:, every], masked[0, first] = -np.inf, -np.inf
    assert top2_gap(masked) > MARGIN
    copy = folder_copy(runner.folder, tmp_path)
    generation = json.loads((copy / "generation_config.json").read_text()) | given
    (copy / "generation_config.json").write_text(json.dumps(generation))
    suppressed = Runner(copy, check_shards=False)
    np.testing.assert_array_equal(suppressed.generate([ids], max_new_tokens=8, stop=())[0], want)
    late = [Request(ids, [], 8), Request(ids, [], 8, arrival=2)]
    for tokens in suppressed.serve(late, stop=())[0]:
        np.testing.assert_array_equal(tokens, want)
    sampled = suppressed.generate([ids] * 2, max_new_tokens=8, stop=(),
                                  sampling=Sampling(top_k=0, seed=3))  # fmt: skip
    assert not np.isin(sampled, every).any() and not np.isin(sampled[:, 0], first).any()
    model = Gemma4.from_params(hf.config.to_dict(), tree_of(hf.state_dict()),
                               generation_config=generation)  # fmt: skip
    got = model.generate(ids[None], max_new_tokens=8, stop=())
    np.testing.assert_array_equal(got[0], want)
