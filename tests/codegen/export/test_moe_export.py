"""MoE checkpoints exported with each way of running the experts (`--moe-prefill`,
`--moe-decode`: dense, gather, nsp): the graphs stay in the op allow-list with no Loop or Scan,
verify (whole and layer by layer) rebuilds `ref` in the same modes, onnxruntime's tokens equal
transformers', the manifest records the modes (an older one reads as dense), and what cannot
apply is refused by name; with the default modes, continuous batching serves each request
transformers' tokens, and so do compute context lengths over a blocked decode."""

import json

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings

from codegen.check.verify import opened, verify
from codegen.export.command import ExportOptions, export
from codegen.folder.manifest import load
from codegen.graphs import GraphError
from codegen.lower.ops import ALLOWED_OPS
from codegen.run.runtime import Runner
from tests.e2e.test_serve import REQUESTS, check_serve
from tests.text_oracle import (
    FIRST_TEXT,
    hf_generate,
    hf_model,
    hf_request,
    padded_rows,
    text_config,
)
from tests.util import examples

NEW_TOKENS = 8
SEQ, CTX = 8, 48
# (experts, top_k, attention_k_eq_v, batch, moe_prefill, moe_decode): QEfficient's defaults
# (nsp prefill over 4 cores, gather decode) on 8 experts top-2 with k_eq_v; the other way
# round on 16 experts top-4
CASES = {
    "e8k2": (8, 2, True, 2, "nsp:packed_chunk=4", None),
    "e16k4": (16, 4, False, 2, "gather", "nsp:num_nsp=8,packed_chunk=1"),
}
_DONE = {}


def _hf(experts, top_k, k_eq_v):
    text = text_config(
        moe=True, layer_types=["sliding_attention", "full_attention"], k_eq_v=k_eq_v, ple=0
    )
    text.update(num_experts=experts, top_k_experts=top_k)
    return hf_model(text, seed=experts + top_k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{case: (transformers model, its checkpoint folder)}."""
    out = {}
    for key, (experts, top_k, k_eq_v, *_) in CASES.items():
        hf = _hf(experts, top_k, k_eq_v)
        folder = tmp_path_factory.mktemp(f"moe-{key}")
        hf.save_pretrained(folder)
        out[key] = hf, folder
    return out


def _export(saved, key, tmp_path_factory):
    if key not in _DONE:
        *_, batch, prefill, decode = CASES[key]
        hf, folder = saved[key]
        out = tmp_path_factory.mktemp("moe-export") / "out"
        export(
            ExportOptions(
                out=out, model=folder, budgets=(), batch_size=batch, seq_len=SEQ, ctx_len=CTX,
                num_cores=4, moe_prefill=prefill, moe_decode=decode, hash_shards=False,
            ),
            log=print,
        )  # fmt: skip
        _DONE[key] = hf, out
    return _DONE[key]


def _ops(path):
    """(standard ops of the graph and its functions, those of its decoder layer functions)."""
    model = onnx.load(path, load_external_data=False)
    layers = [n for f in model.functions if "DecoderLayer" in f.name for n in f.node]
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    standard = lambda ns: {n.op_type for n in ns if n.domain in ("", "ai.onnx")}  # noqa: E731
    return standard(nodes), standard(layers)


@pytest.mark.parametrize("key", sorted(CASES))
def test_run_tokens_equal_transformers_and_ops_stay_allowed(key, saved, tmp_path_factory):
    hf, out = _export(saved, key, tmp_path_factory)
    manifest = json.loads((out / "manifest.json").read_text())
    modes = {g["name"]: g["options"]["moe"] for g in manifest["graphs"]}
    want_modes = {
        "e8k2": {"prefill": "nsp:num_nsp=4,packed_chunk=4", "decode": "gather"},
        "e16k4": {"prefill": "gather", "decode": "nsp:num_nsp=8,packed_chunk=1"},
    }
    assert modes == want_modes[key]
    for g in manifest["graphs"]:
        ops, layer_ops = _ops(out / g["file"])
        assert ops <= ALLOWED_OPS and not ops & {"Loop", "Scan", "If", "OneHot"}, ops
        # nsp packs each expert's tokens with a CumSum inside the layer; gather does not
        assert ("CumSum" in layer_ops) == g["options"]["moe"].startswith("nsp"), g["name"]
    # whole graphs against `ref` in the recorded modes: each case's decode (gather, nsp);
    # e8k2's nsp prefill layer by layer below, e16k4's gather prefill as e8k2's gather decode
    graphs = ["decode"]
    rows = verify(out, check_shards=False, graphs=graphs)
    assert {r[0] for r in rows} == set(graphs) and all(r[-1] for r in rows), rows
    rng = np.random.default_rng(7)
    prompts = [rng.integers(FIRST_TEXT, 96, n) for n in (13, 6)]
    want = [hf_generate(hf, p, [], [], NEW_TOKENS)[0] for p in prompts]
    got = Runner(out).generate(prompts, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(got, padded_rows(want))


def test_verify_layer_by_layer_rebuilds_the_modes(saved, tmp_path_factory):
    """Layer by layer (the nsp prefill graph; the decode graph's gather goes the same way):
    each decoder layer's function in onnxruntime against `ref` in the recorded mode."""
    _, out = _export(saved, "e8k2", tmp_path_factory)
    rows = verify(out, check_shards=False, layerwise_given=True, graphs=["prefill"])
    assert rows and all(r[-1] for r in rows), rows
    # every mode gives dense's numbers, so only the rebuilt spec shows which mode verify ran
    _, _, chosen = opened(out, False, None, None)
    assert {e.name: s.options["moe"] for e, s, _ in chosen} == {
        "prefill": "nsp:num_nsp=4,packed_chunk=4",
        "decode": "gather",
    }


def test_defaults_are_what_qefficient_compiles(saved):
    """No option: decode gather, prefill nsp over --num-cores when it divides the experts
    (packed chunks of 256 when they divide batch × seq_len, else one), dense otherwise."""
    from codegen.export.specs import graph_specs
    from weights import open_checkpoint

    checkpoint = open_checkpoint(saved["e8k2"][1])
    for cores, seq, prefill in [
        (4, 8, "nsp:num_nsp=4,packed_chunk=8"),
        (2, 512, "nsp:num_nsp=2,packed_chunk=256"),
        (16, 8, "dense"),
    ]:
        opts = ExportOptions(out=None, budgets=(), num_cores=cores, seq_len=seq, ctx_len=1024)
        specs = {s.name: s.options["moe"] for s in graph_specs(checkpoint, opts)}
        assert specs == {"prefill": prefill, "decode": "gather"}


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(moe_prefill="nsp:num_nsp=3"), "num_nsp=3 does not divide the 8 experts"),
        (dict(moe_decode="nsp:num_nsp=2,packed_chunk=2"), "packed_chunk=2 does not divide the 1"),
        (dict(moe_prefill="nsp:num_nsp=2,packed_chunk=3"), "packed_chunk=3 does not divide the 8"),
    ],
)
def test_what_cannot_apply_is_refused(saved, options, match, tmp_path):
    with pytest.raises(GraphError, match=match):
        export(ExportOptions(out=tmp_path / "o", model=saved["e8k2"][1], budgets=(),
                             seq_len=SEQ, ctx_len=CTX, **options))  # fmt: skip


def test_a_mode_for_a_checkpoint_without_experts_is_refused_only_when_given(tmp_path):
    from codegen.export.specs import graph_specs
    from weights import open_checkpoint

    hf = hf_model(text_config(moe=False, layer_types=["sliding_attention"], ple=0), seed=1)
    hf.save_pretrained(tmp_path / "dense")
    checkpoint = open_checkpoint(tmp_path / "dense")
    opts = ExportOptions(out=None, budgets=(), seq_len=SEQ, ctx_len=CTX)
    assert {s.options["moe"] for s in graph_specs(checkpoint, opts)} == {"dense"}
    with pytest.raises(GraphError, match="decode graph: moe_decode='gather': the model has no MoE"):
        graph_specs(checkpoint, ExportOptions(out=None, budgets=(), moe_decode="gather"))


def test_an_older_manifest_reads_as_dense(saved, tmp_path_factory):
    _, out = _export(saved, "e8k2", tmp_path_factory)
    data = json.loads((out / "manifest.json").read_text())
    for g in data["graphs"]:
        g["options"].pop("moe", None)
    old = tmp_path_factory.mktemp("old") / "manifest.json"
    old.write_text(json.dumps(data))
    manifest = load(old.parent)
    assert {g.options["moe"] for g in manifest.graphs} == {"dense"}


# Continuous batching and compute context lengths on e8k2 with the MoE defaults (no
# --moe-*: decode gather, prefill nsp over the 4 cores in one chunk of batch × seq_len rows)
SERVE = dict(budgets=(70,), batch_size=2, seq_len=12, ctx_len=96, num_cores=4, hash_shards=False)


def _served_export(saved, tmp_path_factory, name, **options):
    hf, folder = saved["e8k2"]
    out = tmp_path_factory.mktemp(name) / "out"
    export(ExportOptions(out=out, model=folder, **SERVE, **options), log=print)
    manifest = json.loads((out / "manifest.json").read_text())
    modes = {g["name"]: g["options"]["moe"] for g in manifest["graphs"] if g["kind"] != "vision"}
    assert modes == {"prefill": "nsp:num_nsp=4,packed_chunk=24", "decode": "gather"}
    return hf, out


@pytest.fixture(scope="module")
def moe_served(saved, tmp_path_factory):
    """(transformers model, Runner) over e8k2 exported with --full-batch-size 3."""
    hf, out = _served_export(saved, tmp_path_factory, "moe-cb", full_batch_size=3)
    return hf, Runner(out)


@settings(max_examples=examples(1), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**REQUESTS)
def test_continuous_batching_serves_transformers_tokens(moe_served, lengths, data, seed):
    """Requests with images join free slots mid-decode (gather decode over every slot, nsp
    prefill into a slot) and each gets transformers' tokens for it alone."""
    check_serve(*moe_served, lengths, data, seed)


def test_ccl_and_blocked_decode_give_transformers_tokens(saved, tmp_path_factory):
    """Decode compute context lengths 24 and 48 (and 96) with the decode attention in 2 KV
    blocks: two rows, one with an image, crossing both boundaries."""
    hf, out = _served_export(
        saved, tmp_path_factory, "moe-ccl", comp_ctx_lengths_decode=(24, 48),
        decode_blocking=("kv", {"num_kv_blocks": 2}),
    )  # fmt: skip
    rng = np.random.default_rng(11)
    rows, images, want = [], [], []
    for length, grids in ((14, [(6, 6)]), (9, [])):
        while True:  # a request whose greedy picks float32 cannot flip
            ids, patches, tokens, gap = hf_request(hf, rng, length, grids, 40)
            if gap > 1e-4:
                break
        rows.append(ids)
        images += list(zip(patches, grids, strict=True))
        want.append(tokens)
    runner = Runner(out, check_shards=False)
    got = runner.generate(rows, images, max_new_tokens=40)
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[i], w, err_msg=f"row {i}: {runner.ccl_steps}")
    decoded = [k for kind, k in runner.ccl_steps if kind == "decode"]
    assert sorted(set(decoded)) == [24, 48, 96], runner.ccl_steps
