"""Continuous batching over exported graphs (`--full-batch-size`): requests with images and
their own lengths join free slots mid-decode, prefill (two at a time) into their slots with
`batch_index`, decode together over every slot in onnxruntime, and leave at their own length.
Each request's tokens equal transformers' `generate` on that request alone."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from codegen.__main__ import main
from codegen.export import ExportOptions, export
from codegen.runtime import Request, RunError, Runner
from tests.hf_vision import patches_for
from tests.text_oracle import hf_generate, hf_model, prompt, text_config

SLOTS, BATCH = 3, 2
MARGIN = 1e-4
GRIDS = [(3, 3), (6, 6), (6, 9)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(transformers model, Runner) over a continuous-batching export of a dense VLM with
    per-layer embeddings and KV sharing."""
    layers = ["sliding_attention", "full_attention"] * 2
    hf = hf_model(text_config(moe=False, layer_types=layers, shared=2, ple=8, window=5), 17)
    folder = tmp_path_factory.mktemp("cb-model")
    hf.save_pretrained(folder)
    out = tmp_path_factory.mktemp("cb-export") / "out"
    options = dict(budgets=(70,), batch_size=BATCH, seq_len=12, ctx_len=96, hash_shards=False)
    export(ExportOptions(out=out, model=folder, full_batch_size=SLOTS, **options), log=print)
    return hf, Runner(out)


@settings(max_examples=2, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(3, 20), min_size=6, max_size=7),
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
)
def test_each_request_gets_transformers_tokens(served, lengths, data, seed):
    hf, runner = served
    rng = np.random.default_rng(seed)
    requests, want = [], []
    for length in lengths:
        grids = data.draw(st.lists(st.sampled_from(GRIDS), max_size=2))
        new = data.draw(st.integers(2, 8))
        arrival = data.draw(st.integers(0, 8))
        patches = patches_for(grids, rng, 12)
        ids = prompt(rng, length, [h * w // 9 for h, w in grids], 96)
        tokens, logits = hf_generate(hf, ids, patches, grids, new)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        assume((top2[:, 1] - top2[:, 0]).min() > MARGIN)
        requests.append(Request(ids, list(zip(patches, grids, strict=True)), new, arrival))
        want.append(tokens)
    got, timeline = runner.serve(requests)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(g, w, err_msg=f"request {i}\n" + "\n".join(timeline))
    assert any("joins" in line and "decode" in line for line in timeline)


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
    assert main(["serve", runner.folder, "--requests", str(path)]) == 0
    out, err = capsys.readouterr()
    want, _ = hf_generate(hf, ids, patches, [(6, 6)], 4)
    assert out.splitlines()[0] == "request 0: " + ",".join(str(int(t)) for t in want)
    assert "step 2: request 1 joins slot" in err


def test_serve_refuses_bad_requests(served):
    hf, runner = served
    assert runner.slots == SLOTS
    with pytest.raises(RunError, match="request 0: token id 96"):
        runner.serve([Request(np.array([9, 96]), [], 2)])
