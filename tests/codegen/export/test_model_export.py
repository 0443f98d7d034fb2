"""The whole model exported (vision, prefill, decode) and run by `codegen run` in onnxruntime,
token for token against transformers' Gemma4ForConditionalGeneration.generate (greedy).

Two randomized tiny VLMs saved by transformers: dense with per-layer embeddings and KV sharing,
and MoE with attention_k_eq_v; both with a sliding window (5) shorter than their longest
image run (9 tokens). Prompts need several prefill chunks (seq_len 12); batch 2 rows hold
different images, or none. Each export is shared by the examples drawn for it. And at a long
context with continuous batching, no graph stores an array that grows with ctx_len.
"""

import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import numpy_helper

from codegen.__main__ import main
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import default_checkpoint
from codegen.run.device import Program
from codegen.run.runtime import RunError, Runner
from tests.hf_vision import patches_for
from tests.text_oracle import hf_model, hf_request, padded_rows, prompt, text_config
from tests.util import examples

NEW_TOKENS = 12
MARGIN = 1e-4  # float32 runs differ by ~1e-6: a smaller top-2 gap would be a coin toss
GRIDS = [(3, 3), (6, 6), (6, 9), (9, 9)]  # 1, 4, 6 and 9 soft tokens
SEQ_LEN, CTX_LEN, BUDGET = 12, 112, 70
MODELS = {
    "dense": dict(
        moe=False,
        layer_types=["sliding_attention", "full_attention"] * 2,
        shared=2,
        ple=8,
        window=5,
    ),
    "moe": dict(
        moe=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        k_eq_v=True,
        ple=0,
        window=5,
    ),
}
_HF, _EXPORTS = {}, {}


def hf(name):
    if name not in _HF:
        _HF[name] = hf_model(text_config(**MODELS[name]), seed=5 if name == "dense" else 9)
    return _HF[name]


def exported(name, batch, prefill, decode, ring, tmp_path_factory):
    """(transformers model, Runner over its export) for one model and one set of options."""
    key = (name, batch, prefill, decode, ring)
    if key not in _EXPORTS:
        model_dir = tmp_path_factory.mktemp(f"hf-{name}")
        hf(name).save_pretrained(model_dir)
        out = tmp_path_factory.mktemp("export") / "out"
        export(
            ExportOptions(
                out=out,
                model=model_dir,
                budgets=(BUDGET,),
                prefill_blocking=(prefill, {}),
                decode_blocking=(decode, {}),
                sliding_ring=ring,
                batch_size=batch,
                seq_len=SEQ_LEN,
                ctx_len=CTX_LEN,
                hash_shards=False,
            ),
            log=lambda msg: None,
        )
        _EXPORTS[key] = Runner(out)
    return hf(name), _EXPORTS[key]


@st.composite
def requests(draw, batch):
    """Per row: text length and 0–2 images (row 0 always one, the last row of a batch of 2
    none); long enough that the prompt needs several chunks."""
    rows = []
    for i in range(batch):
        images = 0 if (batch > 1 and i == batch - 1) else draw(st.integers(1, 2))
        grids = draw(st.lists(st.sampled_from(GRIDS), min_size=images, max_size=images))
        rows.append((draw(st.integers(14, 30)), grids))
    return rows, draw(st.integers(0, 2**31 - 1))


def oracle(model, rows, seed):
    """Prompts, images in order, transformers' greedy tokens per row, and the smallest top-2
    logit gap over every row and step."""
    rng = np.random.default_rng(seed)
    prompts, images, want, gap = [], [], [], np.inf
    for length, grids in rows:
        ids, patches, tokens, row_gap = hf_request(model, rng, length, grids, NEW_TOKENS)
        gap = min(gap, row_gap)
        prompts.append(ids)
        images += list(zip(patches, grids, strict=True))
        want.append(tokens)
    return prompts, images, padded_rows(want), gap


# (model, batch, prefill mode, decode mode, sliding ring): every prefill mode, decode
# none/kv/hqkv, batch 1 and 2, both models, linear and ring sliding caches
CASES = [
    ("dense", 2, "none", "none", False),
    ("dense", 1, "q", "kv", True),
    ("dense", 2, "kv", "hqkv", False),
    ("moe", 2, "qkv", "kv", False),
    ("moe", 1, "online", "hqkv", True),
    ("moe", 2, "none", "none", True),
]


@pytest.mark.parametrize("name, batch, prefill, decode, ring", CASES)
@settings(max_examples=examples(1))
@given(data=st.data())
def test_run_tokens_equal_transformers(name, batch, prefill, decode, ring, data, tmp_path_factory):
    model, runner = exported(name, batch, prefill, decode, ring, tmp_path_factory)
    rows, seed = data.draw(requests(batch))
    prompts, images, want, gap = oracle(model, rows, seed)
    assume(gap > MARGIN)
    got = runner.generate(prompts, images, max_new_tokens=NEW_TOKENS)
    np.testing.assert_array_equal(got, want)


def _fixed_request(model, seed=3):
    """Row 0: text, a 4-token image, text, a 9-token image (in a later chunk), text."""
    rows = [(24, [(6, 6), (9, 9)])]
    for s in range(seed, seed + 50):
        prompts, images, want, gap = oracle(model, rows, s)
        if gap > MARGIN:
            return prompts, images, want
    raise AssertionError("no seed with a clear greedy margin")


def test_guards_fail_on_the_defects_they_guard(tmp_path_factory, monkeypatch):
    """Feeding back every retained state and giving each chunk its own soft tokens is what
    makes the tokens right: a decode that drops one layer's retained state, or a prefill whose
    every chunk reads the soft tokens from the row's first (as QEfficient's old defect
    restarted image_idx at 0 over the whole vision_embeds), gives other tokens."""
    model, runner = exported("dense", 1, "none", "none", False, tmp_path_factory)
    prompts, images, want = _fixed_request(model)
    assert runner.generate(prompts, images, max_new_tokens=NEW_TOKENS).tolist() == want.tolist()

    keep = Program.run

    def drop_one(self, call, feed, observe=None):
        out = keep(self, call, feed, observe)
        if call == "decode":
            first = sorted(self.state)[0]
            self.state[first] = np.zeros_like(self.state[first])
        return out

    monkeypatch.setattr(Program, "run", drop_one)
    dropped = runner.generate(prompts, images, max_new_tokens=NEW_TOKENS)
    assert dropped.tolist() != want.tolist()
    monkeypatch.setattr(Program, "run", keep)

    window = Runner._window

    def from_the_start(self, streams, offsets, counts):
        return window(self, streams, np.zeros_like(offsets), counts)

    monkeypatch.setattr(Runner, "_window", from_the_start)
    restarted = runner.generate(prompts, images, max_new_tokens=NEW_TOKENS)
    assert restarted.tolist() != want.tolist()


def test_run_refuses_what_the_graphs_cannot_hold(tmp_path_factory):
    model, runner = exported("dense", 1, "none", "none", False, tmp_path_factory)
    rng = np.random.default_rng(0)
    long_run = prompt(rng, 4, [16], 96)  # a 12×12 image: 16 tokens > seq_len 12
    patches = patches_for([(12, 12)], rng, 12)
    with pytest.raises(RunError, match="export with --seq-len 16 or more"):
        runner.generate([long_run], [(patches[0], (12, 12))], max_new_tokens=2)
    with pytest.raises(RunError, match="1 images given, the prompts hold 0"):
        runner.generate([[9, 10]], [(patches[0], (12, 12))], max_new_tokens=2)
    with pytest.raises(RunError, match="token id 96 at 1 is outside"):
        runner.generate([[9, 96]], max_new_tokens=2)
    with pytest.raises(RunError, match="exceed ctx_len=112"):
        runner.generate([[9] * 100], max_new_tokens=13)
    with pytest.raises(RunError, match="2 prompts: the graphs take 1 to batch_size=1"):
        runner.generate([[9], [10]], max_new_tokens=2)


def test_run_command_prints_the_tokens(tmp_path_factory, tmp_path, capsys):
    model, runner = exported("dense", 1, "none", "none", False, tmp_path_factory)
    prompts, images, want = _fixed_request(model)
    args = ["run", runner.folder, "--prompt-ids", ",".join(str(int(t)) for t in prompts[0])]
    for i, (patches, (h, w)) in enumerate(images):
        np.save(tmp_path / f"{i}.npy", patches)
        args += ["--patches", str(tmp_path / f"{i}.npy"), "--grid", f"{h}x{w}"]
    assert main([*args, "--max-new-tokens", str(NEW_TOKENS), "--greedy"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines()[-1] == ",".join(str(int(t)) for t in want[0])
    assert "prefill chunk" in err and "decode step" in err
    assert main(["run", runner.folder, "--prompt-ids", "9,999"]) == 2
    assert "token id 999" in capsys.readouterr().err


def _stored_arrays(model):
    """(name, bytes) of every array an ONNX model holds in itself: initializers without
    external data and Constant nodes, in the graph and in its functions."""
    graphs = [model.graph.node] + [f.node for f in model.functions]
    consts = [
        a.t for nodes in graphs for n in nodes if n.op_type == "Constant" for a in n.attribute
    ]
    inits = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    return [(t.name, numpy_helper.to_array(t).nbytes) for t in inits + consts if t.dims]


@pytest.fixture(scope="module")
def default_model(tmp_path_factory):
    return default_checkpoint(tmp_path_factory.mktemp("default") / "default")


@pytest.mark.parametrize("ring", [False, True])
def test_graphs_store_no_array_that_grows_with_ctx_len(ring, default_model, tmp_path_factory):
    """At a long context with continuous batching, every array a graph stores stays small:
    no cache-sized fill and not the empty run-id record is stored as an initializer (once: a
    [1, Hkv, T, D] spare row per cache, 1 GiB each at ctx 65,536); and every layer writes each
    of its caches with one ScatterND straight into it, nothing else scattered (once: the step's
    rows taken out, written and put back, two more whole-row copies per cache and step)."""
    ctx_len = 4096
    out = tmp_path_factory.mktemp("long-ctx") / "out"
    options = dict(budgets=(), sliding_ring=ring, full_batch_size=2, seq_len=16, ctx_len=ctx_len)
    opts = ExportOptions(out=out, model=default_model, verify=False, hash_shards=False, **options)
    export(opts, log=lambda msg: None)
    bound = 4 * 1024  # below one int32 per slot (4 · ctx_len bytes), far below a cache row
    for name in ("language",):  # prefill and decode: one program
        stored = _stored_arrays(onnx.load(out / f"{name}.onnx", load_external_data=False))
        big = [(t, n) for t, n in stored if n > bound]
        assert not big, f"{name}.onnx stores arrays over {bound} bytes: {big}"
        writes = _cache_writes(onnx.load(out / f"{name}.onnx", load_external_data=False))
        assert writes and all(caches == into for caches, into in writes.values()), writes


def test_blocked_decode_reads_the_step_rows_block_by_block(default_model, tmp_path_factory):
    """With continuous batching and a kv-blocked decode, no layer gathers its step's rows out
    of a whole cache (once: a gathered copy of the written cache per layer and step, 4 GiB of
    float32 at a 31B full layer with 4 slots of 65,536), and each KV block is cut from the
    cache after the block before it has been attended to, so a runtime running nodes in the
    listed order holds one block's tile at a time (once: every tile cut first, ~4 GB more at
    that layer); the export still verifies."""
    out = tmp_path_factory.mktemp("cb-blocked") / "out"
    options = dict(budgets=(), sliding_ring=False, full_batch_size=2, seq_len=8, ctx_len=64)
    blocking = ("kv", {"num_kv_blocks": 4})
    opts = ExportOptions(out=out, model=default_model, decode_blocking=blocking, **options)
    export(opts, log=lambda msg: None)
    model = onnx.load(out / "decode.onnx", load_external_data=False)
    gathers = _whole_cache_gathers(model)
    assert gathers == {}, gathers
    for f, _ in _layer_caches(model):
        written = {n.output[0] for n in f.node if n.op_type == "ScatterND"}
        cuts = [j for j, n in enumerate(f.node) if n.op_type == "Slice" and n.input[0] in written]
        first_matmul = min(j for j, n in enumerate(f.node) if n.op_type == "MatMul" and j > cuts[0])
        assert len(cuts) == 2 * 4 and first_matmul < cuts[-1], (f.name, cuts, first_matmul)


def _layer_caches(model):
    """(layer function, its cache inputs' names inside it) for each function called on
    past_key/past_value graph inputs."""
    functions = {f.name: f for f in model.functions}
    inputs = {i.name for i in model.graph.input}
    for node in model.graph.node:
        f = functions.get(node.op_type)
        pairs = () if f is None else zip(node.input, f.input, strict=True)
        caches = sorted(x for n, x in pairs if n in inputs and "past_" in n)
        if caches:
            yield f, caches


def _whole_cache_gathers(model):
    """{layer function: its gathers whose data is a whole cache (a cache input or a
    ScatterND's written cache)} for each layer function that has one."""
    found = {}
    for f, caches in _layer_caches(model):
        whole = set(caches) | {n.output[0] for n in f.node if n.op_type == "ScatterND"}
        bad = [n.name for n in f.node if n.op_type.startswith("Gather") and n.input[0] in whole]
        if bad:
            found[f.name] = bad
    return found


def _cache_writes(model):
    """{layer function: (its cache inputs, the inputs its ScatterNDs write into)}, for each
    function called on past_key/past_value graph inputs."""
    return {
        f.name: (caches, sorted(n.input[0] for n in f.node if n.op_type == "ScatterND"))
        for f, caches in _layer_caches(model)
    }
