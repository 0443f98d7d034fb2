"""`drift OUT --plans` proves a node-precision plan on the graphs QAIC compiles: the default VLM
with a vision standardize step that overflows float16 (as vLLM #40290 found in 26B/31B) and a
GELU cube that overflows inside one vision layer, its measured plan written by `verify
--precision fp16 --write-npi`, and greedy tokens of the float32 graphs against the float16
device graphs under no plan, the measured plan and QEfficient's rule; the plan file names
nodes as the file compile.sh compiles holds them, and one naming a node the graph does not
have is refused."""

import json
import os
import re
import types

import ml_dtypes
import numpy as np
import onnx
import onnx.inliner
import pytest
from PIL import Image

from codegen.__main__ import main
from codegen.check import spawned
from codegen.check import verify as verify_module
from codegen.check.plan_file import PlanError, read_npi
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import DEFAULT_CONFIG, default_tensors
from codegen.folder import manifest, sessions
from weights import save_checkpoint


def _scaled(t, name, factor):
    t[name] = (t[name].astype(np.float32) * factor).astype(ml_dtypes.bfloat16)


def _overflowing_vlm(folder):
    """The default model with std_bias −65280, std_scale 1e-4 and the tower's last layer ×100:
    h − std_bias passes 65504 in float16, the float32 result is ~6 (tests/codegen/
    test_precision.py's tower, in the whole model); and, inside the second of the tower's
    three calls of its layer function, the MLP's input ×12 with the gate's clip bounds at
    ±1000: GELU's x³ passes 65504 in that call alone."""
    t = default_tensors()
    p = "model.vision_tower."
    t[p + "std_bias"] = np.full_like(t[p + "std_bias"], -65280.0)
    t[p + "std_scale"] = np.full_like(t[p + "std_scale"], 1e-4)
    _scaled(t, p + "encoder.layers.2.post_feedforward_layernorm.weight", 100)
    layer = p + "encoder.layers.1."
    _scaled(t, layer + "pre_feedforward_layernorm.weight", 12)
    for bound, value in (("max", 1000.0), ("min", -1000.0)):
        for side in ("input", "output"):
            name = f"{layer}mlp.gate_proj.{side}_{bound}"
            t[name] = np.full_like(t[name], value)
    save_checkpoint(folder, DEFAULT_CONFIG, t)
    return folder


def _compiled_names(folder, graph):
    """The node output names of the file compile.sh compiles for `graph`, as its flags say
    the compiler reads it: with -sub-functions the top level's and each function body's, as
    written; without, the graph inlined (onnx's inliner)."""
    script = (folder / "compile.sh").read_text()
    (line,) = [x for x in script.splitlines() if f" -m={graph}.onnx " in x]
    model = onnx.load(folder / re.search(r" -m=(\S+)", line).group(1), load_external_data=False)
    if " -sub-functions" in line:
        bodies = [model.graph.node] + [f.node for f in model.functions]
    else:
        bodies = [onnx.inliner.inline_local_functions(model).graph.node]
    return {o for nodes in bodies for n in nodes for o in n.output}


def _opened_count(monkeypatch):
    """[manifest reads, shard checks] counted from now on (`codegen.folder.opened`: once a
    command)."""
    counts, load, check = [0, 0], manifest.load, sessions.check_folder

    def counted_load(*a, **k):
        counts[0] += 1
        return load(*a, **k)

    def counted_check(*a, **k):
        counts[1] += 1
        return check(*a, **k)

    monkeypatch.setattr(manifest, "load", counted_load)
    monkeypatch.setattr(sessions, "check_folder", counted_check)
    return counts


def test_the_measured_plan_gives_float32_tokens_and_no_plan_does_not(tmp_path, capsys,
                                                                      monkeypatch):  # fmt: skip
    out = tmp_path / "out"
    model = _overflowing_vlm(tmp_path / "ckpt")
    export(ExportOptions(out=out, model=model, budgets=(70,), verify=False), log=lambda m: None)
    # the language program: prefill and decode specializations of one graph
    plan_args = ["--write-npi", "--graph", "vision", "--graph", "language"]
    assert main(["verify", str(out), "--precision", "fp16", *plan_args]) == 0
    report = capsys.readouterr().out
    assert "vision: 2 node(s) in float32 (4 in all calls)" in report, report
    assert "language: 0 node(s)" in report, report
    assert (out / "vision.npi.yaml").exists() and not (out / "language.npi.yaml").exists()
    graph = onnx.load(out / "vision.onnx", load_external_data=False)
    # the GELU cube by its body name (kept in all three calls), the standardize Sub at the top
    plan = ["Layer/gelu_mul_1", "sub_out_1"]
    assert read_npi(out / "vision.npi.yaml", graph) == plan
    assert set(plan) <= _compiled_names(out, "vision")  # each name, as compile.sh reads it
    cube = [f"encoder.layers.{k}.mlp:integer_pow#0" for k in range(3)]
    assert f"Layer/gelu_mul_1 (Mul) in each of Layer's 3 call(s) = ref {', '.join(cube)}" in (
        report
    ), report
    assert "sub_out_1 (Sub) = ref VisionModel:sub#0" in report, report  # paired in ref
    paired = json.loads((out / "vision.npi.ref.json").read_text())
    assert paired["nodes"] == [
        {"onnx": "Layer/gelu_mul_1", "op": "Mul", "ref": cube},
        {"onnx": "sub_out_1", "op": "Sub", "ref": ["VisionModel:sub#0"]},
    ]
    assert "$(npi vision)" in (out / "compile.sh").read_text()  # -node-precision-info
    # verify honours the plan in both device models (either one ignoring it exits 1)
    check = ["verify", str(out), "--precision", "fp16", "--graph", "vision"]
    assert main(check) == 0
    report = capsys.readouterr().out
    assert "plan vision.npi.yaml: 2 node(s) in float32, 2 of them in ref" in report, report
    assert main([*check, "--no-npi"]) == 1
    capsys.readouterr()
    # a name the compiled file does not hold: onnx's inliner's name for one call's node, a
    # body's name without its function, a made-up one
    for bad in ("Layer/gelu_mul_1__2", "gelu_mul_1", "no_such_node"):
        (out / "bad.npi.yaml").write_text(f'FP32NodeInstanceNames:\n  - "{bad}"\n')
        assert bad not in _compiled_names(out, "vision")
        with pytest.raises(PlanError, match=f"'{bad}' is not in graph 'vision' at its top"):
            read_npi(out / "bad.npi.yaml", graph)
    args = ["drift", str(out), "--plans", "--prompts", "2", "--max-new-tokens", "3"]
    opened = _opened_count(monkeypatch)
    assert main(args) == 0
    assert opened == [1, 0], opened  # four Runners, one opened folder (shards not checked)
    rows = {line[:18].strip(): line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["none"][1:3] == ["0", "0/6"], rows  # NaN soft tokens: no token right
    assert rows["measured"][1:3] == ["4", "6/6"], rows  # the cube in 3 calls, the Sub
    assert int(rows["QEfficient's rule"][2]) > 1000 and rows["QEfficient's rule"][3] == "6/6", rows
    # calibrated on the user's own request instead: a photo's vision call overflows the same
    # nodes; requests that never call the vision graph cannot plan it (and write nothing)
    (out / "vision.npi.yaml").unlink()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (20, 12, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    asks = tmp_path / "asks.jsonl"
    # placeholder ids (no tokenizer here): bos, a word, the image token (4), a word
    asks.write_text(json.dumps({"prompt_ids": [2, 10, 4, 11], "images": ["a.png"],
                                "max_new_tokens": 2}))  # fmt: skip
    calibrate = [
        "verify",
        str(out),
        "--precision",
        "fp16",
        "--write-npi",
        "--prompts",
        str(asks),
        "--graph",
        "vision",
    ]  # the language graphs' calibration: plans of 0 nodes
    opened = _opened_count(monkeypatch)
    assert main(calibrate) == 0
    assert opened == [1, 1], opened  # the folder opened once, its calibration Runner on it
    report = capsys.readouterr().out
    assert "vision: 2 node(s) in float32" in report and "request 1 vision 1" in report, report
    assert read_npi(out / "vision.npi.yaml", graph) == plan
    (out / "vision.npi.yaml").unlink()
    asks.write_text(json.dumps({"prompt_ids": [2, 10, 11], "max_new_tokens": 2}))
    assert main(calibrate) == 2
    assert "no request in" in capsys.readouterr().err
    assert not (out / "vision.npi.yaml").exists()


def test_a_plan_made_layer_by_layer_names_the_whole_graphs_nodes(tmp_path, capsys, monkeypatch):
    """Token embeddings ×60 push one GELU product per decoder layer past float16 (the same
    node inside each of the four layer functions, one call each). The layer-by-layer search
    (a released size's way, here forced by --layerwise) runs one segment at a time, where
    onnx's inliner names a layer call's values "…__1" (in the whole graph "…__N"); its plan
    must name each node by its function body's name, as the whole-graph plan does (the
    whole-graph search names them so: the vision test above), and pair it with ref's GELU
    cube in that layer. Planned again as a graph over the layer-by-layer threshold is (the
    search, then the pairing, each in a spawned process: `npi.plan_layers`), the plan and its
    pairs are the same. The plan is then honoured by a check in a spawned process, as such a
    graph is checked."""
    t = default_tensors()
    _scaled(t, "model.language_model.embed_tokens.weight", 60)
    save_checkpoint(tmp_path / "ckpt", DEFAULT_CONFIG, t)
    out = tmp_path / "out"
    export(ExportOptions(out=out, model=tmp_path / "ckpt", budgets=(70,), verify=False,
                         phases=("decode",)), log=lambda m: None)  # fmt: skip
    graph = onnx.load(out / "decode.onnx", load_external_data=False)
    args = ["verify", str(out), "--precision", "fp16", "--graph", "decode", "--layerwise"]
    assert main([*args, "--write-npi"]) == 0
    capsys.readouterr()
    plan = read_npi(out / "decode.npi.yaml", graph)
    paired = json.loads((out / "decode.npi.ref.json").read_text())
    monkeypatch.setattr(verify_module, "LAYERWISE_BYTES", 0)  # checked in a spawned process
    pools = _counted_pools(monkeypatch)
    assert main([*args, "--write-npi"]) == 0
    capsys.readouterr()
    assert pools == [1, 1], pools  # the search's child, then the pairing's
    assert read_npi(out / "decode.npi.yaml", graph) == plan
    assert json.loads((out / "decode.npi.ref.json").read_text()) == paired
    pools.clear()
    assert main(args) == 0  # the plan honoured, both device models finite
    assert "plan decode.npi.yaml: 4 node(s) in float32" in capsys.readouterr().out
    assert pools == [1], pools  # one child, which honoured the plan
    kinds = ("Sliding", "Full", "SlidingShared", "FullShared")
    assert plan == [f"{kind}DecoderLayer/gelu_mul_6" for kind in kinds], plan
    assert set(plan) <= _compiled_names(out, "decode")
    assert paired["parted"] is None, paired
    # GELU's x³: the graph's (x·x)·x, ref's integer_pow, in each layer's own body
    assert [n["ref"] for n in paired["nodes"]] == [
        [f"layers.{k}:integer_pow#0"] for k in range(4)
    ], paired


def _counted_pools(monkeypatch):
    """[processes of each pool `spawned.spawned` opened (`precision.isolated`,
    `npi.plan_layers`)], pools counted as they open."""
    real, pools = spawned.ProcessPoolExecutor, []

    def counted(n, **kw):
        pools.append(n)
        return real(n, **kw)

    monkeypatch.setattr(spawned, "ProcessPoolExecutor", counted)
    return pools


def test_ref_pairing_stops_where_the_device_models_part():
    """`RefPlan` pairs a graph node with ref's first non-finite tensor only when both make the
    same operation; where they part (another operation, or only one side overflows) it says
    where and pairs nothing after, so a plan never names a ref tensor for the wrong node."""
    from codegen.check.npi import RefPlan
    from ref.numerics import Record

    def record(primitive):
        return Record("VisionModel", primitive, (2, 3), 0.0, True)

    seen = []
    answers = iter([record("sub"), record("integer_pow"), record("exp"), record("add")])

    def first(feed, keep):
        seen.append(keep)
        return next(answers)

    ref = RefPlan(first)
    assert ref.pair("a", {}, ("sub_out_1", "Sub")) == ["VisionModel:sub#0"]
    assert ref.pair("a", {}, ("gelu_mul_6", "Mul")) == ["VisionModel:integer_pow#0"]
    assert ref.parted is None and seen == [(), ("VisionModel:sub#0",)]
    assert ref.pair("b", {}, ("add_out_3", "Add")) is None  # ref's first is an exp
    assert "b: the graph turns 'add_out_3' (Add) non-finite first, ref VisionModel:exp#0" in (
        ref.parted
    )
    assert ref.pair("b", {}, ("add_out_4", "Add")) is None and len(seen) == 3  # no more runs
    alone = RefPlan(lambda feed, keep: record("sub"))
    assert alone.pair("c", {}) is None and "the graph turns nothing" in alone.parted


def _two_calls():
    """A graph calling function F twice (layers 3 and 5), F's body values scoped as the
    export scopes them ("F/…"), and a top-level Add."""
    from onnx import TensorProto, helper

    body = [
        helper.make_node("Mul", ["x", "w"], ["F/sq"]),
        helper.make_node("Add", ["F/sq", "x"], ["F/out"]),
    ]
    f = helper.make_function("custom", "F", ["x", "w"], ["F/out"], body,
                             [helper.make_opsetid("", 18)])  # fmt: skip
    nodes = [
        helper.make_node("F", ["a", "model.layers.3.w"], ["h1"], domain="custom", name="F_1"),
        helper.make_node("F", ["h1", "model.layers.5.w"], ["h2"], domain="custom", name="F_2"),
        helper.make_node("Add", ["h2", "a"], ["sum"]),
    ]
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("a", "sum")]
    weights = [helper.make_tensor(f"model.layers.{k}.w", TensorProto.FLOAT, [2], [1.0, 2.0])
               for k in (3, 5)]  # fmt: skip
    graph = helper.make_graph(nodes, "g", value[:1], value[1:], weights)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("custom", 1)]
    return helper.make_model(graph, opset_imports=opsets, functions=[f])


def test_a_body_name_keeps_its_node_in_every_call_as_the_inliner_names_them():
    """`instances` and `plan_names` against onnx's own inliner: a body name stands for its node
    in each call (the inliner's "…__N" of call N), a call's result is its top-level name,
    and `every_call` spreads a `ref` key to each layer the function computes."""
    from codegen.check.npi import every_call
    from codegen.check.plan_file import instances, plan_names

    model = _two_calls()
    inlined = [o for n in onnx.inliner.inline_local_functions(model).graph.node for o in n.output]
    squares = sorted(o for o in inlined if o.startswith("F/sq"))
    assert len(squares) == 2 and sorted(instances(model, ["F/sq"])) == squares
    assert instances(model, ["F/out"]) == {"h1", "h2"}  # a result: each call's output
    assert instances(model, ["sum", "h2"]) == {"sum", "h2"}
    named = plan_names(model)
    assert set(named) == set(inlined) and {named[s] for s in squares} == {"F/sq"}
    assert named["h1"] == "h1"
    spread = every_call(model)
    want = ["layers.3.mlp:mul#0", "layers.5.mlp:mul#0"]
    assert spread("F/sq", "layers.5.mlp:mul#0") == want
    assert spread("sum", "layers.5.mlp:add#0") == ["layers.5.mlp:add#0"]  # top level: itself
    assert spread("F/sq", "layers.4.mlp:mul#0") == ["layers.4.mlp:mul#0"]  # not F's layer


def test_huge_pages_are_asked_of_a_large_graphs_child_only(monkeypatch):
    """`spawned.spawned` starts a child with glibc.malloc.hugetlb=1 added to GLIBC_TUNABLES
    (kept beside what is there; a hugetlb setting already there wins) for a graph of
    HUGE_BYTES of float32 weights or more, and leaves the environment as it was after."""
    seen = []

    class Pool:
        def __init__(self, n, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            seen.append(os.environ.get("GLIBC_TUNABLES"))
            return types.SimpleNamespace(result=lambda: "done")

    monkeypatch.setattr(spawned, "ProcessPoolExecutor", Pool)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert spawned.spawned(print, weights=spawned.HUGE_BYTES - 1) == "done"
    assert spawned.spawned(print, weights=spawned.HUGE_BYTES) == "done"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    spawned.spawned(print, weights=spawned.HUGE_BYTES)
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    spawned.spawned(print, weights=spawned.HUGE_BYTES)
    huge = "glibc.malloc.hugetlb=1"
    assert seen == [None, huge, f"glibc.malloc.arena_max=2:{huge}", "glibc.malloc.hugetlb=0"]
