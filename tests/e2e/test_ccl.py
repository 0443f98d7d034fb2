"""Compute context lengths (QEfficient's CCL, `--comp-ctx-lengths-prefill/-decode`): one
prefill and one decode graph whose `comp_ctx_lengths` input's length K cuts the keys each step
attends to to the first K cache slots, a specialization per K. `run` and `serve` feed each step
the least K above its positions; tokens equal transformers' `generate` across several K
boundaries, and a graph at K provably reads no cache slot at or past K."""

import json

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from codegen.__main__ import main
from codegen.check.verify import verify
from codegen.export.command import ExportOptions, export
from codegen.export.options import ExportError
from codegen.graphs import GraphError
from codegen.run.runtime import Request, RunError, Runner, ccl_for
from tests.hf_vision import patches_for
from tests.text_oracle import hf_generate, hf_model, hf_request, prompt, text_config, top2_gap
from tests.util import examples

MARGIN = 1e-4
CTX, SEQ = 96, 12
PREFILL, DECODE = (24, 48), (24, 36, 48, 72)  # ctx_len 96 is appended to both
OPTIONS = dict(budgets=(70,), seq_len=SEQ, ctx_len=CTX, hash_shards=False)
FIXTURES = [HealthCheck.function_scoped_fixture]


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """(transformers model, its checkpoint folder): a dense VLM with per-layer embeddings, KV
    sharing and a sliding window of 5."""
    layers = ["sliding_attention", "full_attention"] * 2
    hf = hf_model(text_config(moe=False, layer_types=layers, shared=2, ple=8, window=5), 23)
    folder = tmp_path_factory.mktemp("ccl-model")
    hf.save_pretrained(folder)
    return hf, folder


# prefill in query chunks × KV blocks, decode in KV blocks cut in two head-parallel pieces
# each: a symbolic K is cut into exact blocks (every K a multiple of 3, and of 3 × 2)
BLOCKED = dict(
    prefill_blocking=("qkv", {"num_kv_blocks": 3, "prefill_block_chunks": 2}),
    decode_blocking=("kv_headpar", {"num_kv_blocks": 3, "headpar_split": 2, "skip_kv": True}),
)
SETUPS = {"ring": dict(sliding_ring=True), "no-ring": dict(sliding_ring=False),
          "blocked": dict(sliding_ring=False, **BLOCKED)}  # fmt: skip


@pytest.fixture(scope="module", params=list(SETUPS))
def exported(hf_saved, tmp_path_factory, request):
    """(transformers model, export folder) with CCL lists on both phases and two rows; sliding
    layers in a ring (read whole: the ring holds the window) or at ctx_len slots (cut like
    full layers), attention dense or blocked. Each is verified by
    `test_specializations_manifest_and_verify_cover_every_ccl` alone (the blocked one layer by
    layer), not also as it is written."""
    hf, folder = hf_saved
    out = tmp_path_factory.mktemp("ccl-export") / "out"
    export(
        ExportOptions(
            out=out,
            model=folder,
            batch_size=2,
            comp_ctx_lengths_prefill=PREFILL,
            comp_ctx_lengths_decode=DECODE,
            verify=False,
            **SETUPS[request.param],
            **OPTIONS,
        ),
        log=print,
    )
    return hf, out


@settings(max_examples=examples(2), suppress_health_check=FIXTURES, deadline=None)
@given(
    lengths=st.lists(st.integers(4, 30), min_size=2, max_size=2),
    grids=st.lists(st.sampled_from([(3, 3), (6, 6)]), max_size=1),
    seed=st.integers(0, 2**31 - 1),
)
# a row that generates an image id (4) at its fourth token: text, as transformers embeds it (a
# language program's decode specialization once merged a zero soft token there)
@example(lengths=[13, 4], grids=[(6, 6)], seed=640)
def test_generate_crosses_ccl_boundaries_with_transformers_tokens(exported, lengths, grids, seed):
    """Two rows of different lengths decode 40 tokens through at least three decode CCLs
    (crossing two boundaries or more); every step gets the least K above its positions and the
    tokens are transformers'. Neither side stops at `<eos>`: all 40 steps are needed to cross
    the boundaries (before, a row whose transformers tokens hit `<eos>` failed on the runner's
    padding, depending on the draw)."""
    hf, out = exported
    rng = np.random.default_rng(seed)
    new = 40
    rows, images, want = [], [], []
    for i, length in enumerate(lengths):
        row_grids = grids if i == 0 else []
        patches = patches_for(row_grids, rng, 12)
        ids = prompt(rng, length, [h * w // 9 for h, w in row_grids], 96)
        tokens, logits = hf_generate(hf, ids, patches, row_grids, new, eos=None)
        assume(top2_gap(logits) > MARGIN)
        rows.append(ids)
        images += list(zip(patches, row_grids, strict=True))
        want.append(tokens)
    runner = Runner(out, check_shards=False)
    got = runner.generate(rows, images, max_new_tokens=new, stop=())
    for i, w in enumerate(want):
        np.testing.assert_array_equal(got[i], w, err_msg=f"row {i}: {runner.ccl_steps}")
    decoded = [k for kind, k in runner.ccl_steps if kind == "decode"]
    assert len(set(decoded)) >= 3, runner.ccl_steps
    assert decoded == sorted(decoded)  # one row set: positions only grow
    top = max(map(len, rows)) + new - 2  # the last decode step's position
    assert decoded[-1] == ccl_for((*DECODE, CTX), [top])


def _decode_session(out, seed):
    """(a function of a decode step's feed (its caches, ids, positions and comp_ctx_lengths) →
    logits, by the export's decode graph, or its language program at its decode
    specialization (a one-row vision_embeds of zeros); {cache input: random float32 array}
    for its 2 rows)."""
    one = (out / "language.onnx").exists()
    session = ort.InferenceSession(str(out / ("language.onnx" if one else "decode.onnx")))
    rng = np.random.default_rng(seed)
    symbols = {"batch_size": 2, "ctx_len": CTX}
    caches = {
        i.name: rng.standard_normal([symbols.get(d, d) for d in i.shape]).astype(np.float32)
        for i in session.get_inputs()
        if i.name.startswith("past_")
    }
    hidden = (
        next(i.shape[2] for i in session.get_inputs() if i.name == "vision_embeds") if one else 0
    )
    media = {"vision_embeds": np.zeros((2, 1, hidden), np.float32),
             "image_idx": np.ones((2, 1), np.int32)} if one else {}  # fmt: skip
    return lambda feed: session.run(["logits"], {**feed, **media})[0], caches


def test_a_graph_reads_no_slot_at_or_past_its_ccl(exported):
    """Decode at K = 36 with NaN in every cache slot ≥ K: the logits are finite and equal the
    same step with zeros there. The same NaN cache at K = 72 (slots 36… attended, masked as
    empty) gives NaN: what the cut saves is real reading, not a mask."""
    session, caches = _decode_session(exported[1], 3)
    feed = {"input_ids": np.array([[9], [10]], np.int32), "position_ids": np.array([[30], [35]])}
    feed["position_ids"] = feed["position_ids"].astype(np.int32)
    nan_feed, zero_feed = dict(feed), dict(feed)
    for name, x in caches.items():
        zero_feed[name], nan_feed[name] = x.copy(), x.copy()
        if x.shape[2] == CTX:  # a ring's slots are positions mod 5: always read
            zero_feed[name][:, :, 36:] = 0
            nan_feed[name][:, :, 36:] = np.nan

    def logits(f, k):
        return session({**f, "comp_ctx_lengths": np.zeros(k, np.int64)})

    cut = logits(nan_feed, 36)
    assert np.isfinite(cut).all()
    np.testing.assert_array_equal(cut, logits(zero_feed, 36))
    assert np.isnan(logits(nan_feed, 72)).all()


def test_the_last_position_a_ccl_holds_is_k_minus_1(exported):
    """A decode step at position K − 1 (the last slot K holds) gives the logits of the same
    step at K = ctx_len; at position K the graph silently drops the step's own key (what the
    runner's rule, K above every position, prevents): the logits move."""
    session, caches = _decode_session(exported[1], 4)

    def logits(position, k):
        feed = dict(caches)
        feed.update(
            input_ids=np.array([[9], [10]], np.int32),
            position_ids=np.full((2, 1), position, np.int32),
            comp_ctx_lengths=np.zeros(k, np.int64),
        )
        return session(feed)

    np.testing.assert_allclose(logits(35, 36), logits(35, CTX), rtol=0, atol=1e-5)
    assert np.abs(logits(36, 36) - logits(36, CTX)).max() > 1e-3


def test_specializations_manifest_and_verify_cover_every_ccl(exported):
    """specializations.json has one entry per K (× budget for prefill) with the symbol
    comp_ctx_lengths; the input is int64 [comp_ctx_lengths]; verify checks each of them (the
    blocked export layer by layer)."""
    _, out = exported
    manifest = json.loads((out / "manifest.json").read_text())
    graphs = {g["kind"]: g for g in manifest["graphs"]}
    one = "language" in graphs  # prefill and decode specializations of one program
    for phase, ccls in (("prefill", (*PREFILL, CTX)), ("decode", (*DECODE, CTX))):
        name = "language" if one else phase
        specs = json.loads((out / f"{name}.specializations.json").read_text())["specializations"]
        specs = [s for s in specs if s["name"].startswith(phase)]
        assert [s["symbols"]["comp_ctx_lengths"] for s in specs] == [str(k) for k in ccls]
        assert all(s["name"].endswith(f"_ccl{k}") for s, k in zip(specs, ccls, strict=True))
    decode = graphs["language" if one else "decode"]
    lengths = decode["options"]["decode_comp_ctx_lengths" if one else "comp_ctx_lengths"]
    assert lengths == [*DECODE, CTX]
    ccl = next(t for t in decode["inputs"] if t["name"] == "comp_ctx_lengths")
    assert (ccl["dtype"], ccl["shape"]) == ("int64", ["comp_ctx_lengths"])
    blocked = decode["options"]["mode"] != "none"  # layer by layer there (a minute)
    rows = verify(out, seed=2, check_shards=False, layerwise_given=blocked or None)
    checked = {r[1] for r in rows}
    assert {f"decode_ccl{k}" for k in (*DECODE, CTX)} <= checked
    assert {f"prefill_70_ccl{k}" for k in (*PREFILL, CTX)} <= checked
    assert all(r[-1] for r in rows), rows


@pytest.fixture(scope="module", params=["dense", "kv_batch_fold"])
def served(hf_saved, tmp_path_factory, request):
    """(transformers model, Runner) over a continuous-batching CCL export of `hf_saved`, its
    decode dense or batch-folded (caches [1, 2·Hkv, T, D], K cut into 3 exact KV blocks); the
    batch-folded one verified layer by layer at every K (the dense one by its tokens; dense
    CCL graphs are verified at every K by `test_specializations_manifest_and_verify_…`)."""
    hf, folder = hf_saved
    out = tmp_path_factory.mktemp("ccl-cb") / "out"
    options = dict(batch_size=1, full_batch_size=2, comp_ctx_lengths_decode=DECODE, **OPTIONS)
    if request.param != "dense":
        options["decode_blocking"] = (request.param, {"num_kv_blocks": 3})
    export(ExportOptions(out=out, model=folder, verify=False, **options), log=print)
    if request.param != "dense":
        rows = verify(out, seed=3, check_shards=False, layerwise_given=True, graphs=["decode"])
        assert len({r[1] for r in rows}) == len(DECODE) + 1 and all(r[-1] for r in rows), rows
    return hf, Runner(out, check_shards=False)


def test_serve_follows_the_occupied_slots_only(served):
    """A long request leaves; a short one that joined later keeps decoding: its steps go back
    to the least K above its own positions (QEfficient's runner keeps the finished slot's
    positions in its max). Both get transformers' tokens."""
    hf, runner = served
    rng = np.random.default_rng(11)
    want, requests = [], []
    for length, new, arrival in ((28, 26, 0), (4, 34, 6)):
        ids, patches, tokens, gap = hf_request(hf, rng, length, [], new)
        assert gap > MARGIN
        requests.append(Request(ids, [], new, arrival))
        want.append(tokens)
    runner.ccl_steps.clear()
    got, timeline = runner.serve(requests)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w, err_msg="\n".join(timeline))
    decoded = [k for kind, k in runner.ccl_steps if kind == "decode"]
    assert 72 in decoded and decoded[-1] < 72, decoded  # down once the long request left
    # a phase given no list takes no comp_ctx_lengths; in one program (the dense decode) the
    # graph takes it at every specialization, ctx_len at prefill's
    one = runner.programs["prefill"] is runner.programs["decode"]
    assert runner.ccls["prefill"] == ((CTX,) if one else ())


def test_run_command_takes_the_options(hf_saved, tmp_path, capsys):
    """`export --comp-ctx-lengths-decode` then `run`: transformers' tokens."""
    hf, folder = hf_saved
    out = tmp_path / "out"
    args = ["export", "--model", str(folder), "--out", str(out), "--seq-len", "12",
            "--ctx-len", "96", "--budgets", "70", "--comp-ctx-lengths-decode", "16,32",
            "--no-verify"]  # fmt: skip
    assert main(args) == 0
    rng = np.random.default_rng(5)
    patches = patches_for([(6, 6)], rng, 12)
    ids = prompt(rng, 9, [4], 96)
    want, _ = hf_generate(hf, ids, patches, [(6, 6)], 30)
    np.save(tmp_path / "p.npy", patches[0])
    run = ["run", str(out), "--prompt-ids", ",".join(map(str, ids)), "--patches",
           str(tmp_path / "p.npy"), "--grid", "6x6", "--max-new-tokens", "30",
           "--greedy"]  # fmt: skip
    assert main(run) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.endswith(",".join(str(int(t)) for t in want))
    specs = json.loads((out / "language.specializations.json").read_text())["specializations"]
    # one program: prefill given no lengths binds ctx_len, decode each of its own
    assert [(s["name"], s["symbols"]["comp_ctx_lengths"]) for s in specs] == [
        ("prefill_70_ccl96", "96"), ("decode_ccl16", "16"), ("decode_ccl32", "32"),
        ("decode_ccl96", "96"),
    ]  # fmt: skip


def test_disaggregated_sides_each_take_their_own_lists(hf_saved, tmp_path):
    """A --prefill-only export with prefill lengths hands its cache to a --decode-only export
    with decode lengths (QEfficient's disaggregated CCL: each side's list alone): each side
    takes its own K, and the tokens are transformers'."""
    hf, folder = hf_saved
    sides = {}
    for phase, lists in (("prefill", {"comp_ctx_lengths_prefill": (24,)}),
                         ("decode", {"comp_ctx_lengths_decode": (24, 48)})):  # fmt: skip
        sides[phase] = tmp_path / phase
        options = dict(OPTIONS, phases=(phase,), verify=False, **lists)
        export(ExportOptions(out=sides[phase], model=folder, **options), log=print)
    rng = np.random.default_rng(6)
    patches = patches_for([(6, 6)], rng, 12)
    ids = prompt(rng, 14, [4], 96)
    want, _ = hf_generate(hf, ids, patches, [(6, 6)], 36)
    runner = Runner(sides["prefill"], decode_folder=sides["decode"], check_shards=False)
    got = runner.generate([ids], [(patches[0], (6, 6))], max_new_tokens=36)
    np.testing.assert_array_equal(got[0], want)
    assert {k for kind, k in runner.ccl_steps if kind == "prefill"} == {24}
    assert {k for kind, k in runner.ccl_steps if kind == "decode"} == {24, 48, CTX}


@pytest.mark.parametrize(
    "options, error, match",
    [
        (dict(comp_ctx_lengths_decode=(0, 32)), ExportError, r"--comp-ctx-lengths-decode 0"),
        (dict(comp_ctx_lengths_decode=(128,)), ExportError, r"ctx_len=96"),
        (dict(comp_ctx_lengths_prefill=(8,)), ExportError, r"seq_len=12"),
        (
            dict(comp_ctx_lengths_decode=(24, 40), **BLOCKED),
            GraphError,
            r"decode compute context length 40: .* expected a multiple of 6",
        ),
    ],
)
def test_bad_lists_are_refused_by_name(hf_saved, tmp_path, options, error, match):
    _, folder = hf_saved
    out = tmp_path / "out"
    with pytest.raises(error, match=match):
        export(ExportOptions(out=out, model=folder, **{**OPTIONS, **options}), log=print)
    assert not out.exists()


def test_ccl_for_is_the_least_length_above_the_valid_positions():
    assert ccl_for((24, 48, 96), [[23, -1]]) == 24
    assert ccl_for((24, 48, 96), [[24], [-1]]) == 48
    assert ccl_for((24, 48, 96), [[-1, -1]]) == 24
    with pytest.raises(RunError, match="position 96"):
        ccl_for((24, 48, 96), [[96]])
