"""`drift OUT --plans` proves a node-precision plan on the graphs QAIC compiles: the default VLM
with a vision standardize step that overflows float16 (as vLLM #40290 found in 26B/31B), its
measured plan written by `verify --precision fp16 --write-npi`, and greedy tokens of the
float32 graphs against the float16 device graphs under no plan, the measured plan and
QEfficient's rule; the plan file is what compile.sh passes, and one naming a node the graph
does not have is refused."""

import json

import ml_dtypes
import numpy as np
import onnx
import pytest
from PIL import Image

from codegen.__main__ import main
from codegen.check import precision
from codegen.check import verify as verify_module
from codegen.check.plan_file import PlanError, read_npi
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import DEFAULT_CONFIG, default_tensors
from weights import save_checkpoint


def _overflowing_vlm(folder):
    """The default model with std_bias −65280, std_scale 1e-4 and the tower's last layer ×100:
    h − std_bias passes 65504 in float16, the float32 result is ~6 (tests/codegen/
    test_precision.py's tower, in the whole model)."""
    t = default_tensors()
    p = "model.vision_tower."
    t[p + "std_bias"] = np.full_like(t[p + "std_bias"], -65280.0)
    t[p + "std_scale"] = np.full_like(t[p + "std_scale"], 1e-4)
    w = p + "encoder.layers.2.post_feedforward_layernorm.weight"
    t[w] = (t[w].astype(np.float32) * 100).astype(ml_dtypes.bfloat16)
    save_checkpoint(folder, DEFAULT_CONFIG, t)
    return folder


def test_the_measured_plan_gives_float32_tokens_and_no_plan_does_not(tmp_path, capsys):
    out = tmp_path / "out"
    model = _overflowing_vlm(tmp_path / "ckpt")
    export(ExportOptions(out=out, model=model, budgets=(70,), verify=False), log=lambda m: None)
    assert main(["verify", str(out), "--precision", "fp16", "--write-npi"]) == 0
    report = capsys.readouterr().out
    assert "vision: 1 node(s) in float32" in report and "prefill: 0 node(s)" in report, report
    assert (out / "vision.npi.yaml").exists() and not (out / "prefill.npi.yaml").exists()
    graph = onnx.load(out / "vision.onnx", load_external_data=False)
    assert read_npi(out / "vision.npi.yaml", graph) == ["sub_out_1"]  # the standardize Sub
    assert "sub_out_1 (Sub) = ref VisionModel:sub#0" in report, report  # paired in ref
    paired = json.loads((out / "vision.npi.ref.json").read_text())
    assert paired["nodes"] == [{"onnx": "sub_out_1", "op": "Sub", "ref": "VisionModel:sub#0"}]
    assert "$(npi vision)" in (out / "compile.sh").read_text()  # -node-precision-info
    # verify honours the plan in both device models (either one ignoring it exits 1)
    check = ["verify", str(out), "--precision", "fp16", "--graph", "vision"]
    assert main(check) == 0
    report = capsys.readouterr().out
    assert "plan vision.npi.yaml: 1 node(s) in float32, 1 of them in ref" in report, report
    assert main([*check, "--no-npi"]) == 1
    capsys.readouterr()
    (out / "bad.npi.yaml").write_text('FP32NodeInstanceNames:\n  - "no_such_node"\n')
    with pytest.raises(PlanError, match="node output 'no_such_node' is not in the graph"):
        read_npi(out / "bad.npi.yaml", graph)
    args = ["drift", str(out), "--plans", "--prompts", "2", "--max-new-tokens", "3"]
    assert main(args) == 0
    rows = {line[:18].strip(): line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows["none"][1:3] == ["0", "0/6"], rows  # NaN soft tokens: no token right
    assert rows["measured"][1:3] == ["1", "6/6"], rows
    assert int(rows["QEfficient's rule"][2]) > 1000 and rows["QEfficient's rule"][3] == "6/6", rows
    # calibrated on the user's own request instead: a photo's vision call overflows the same
    # Sub; requests that never call the vision graph cannot plan it (and write nothing)
    (out / "vision.npi.yaml").unlink()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (20, 12, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    asks = tmp_path / "asks.jsonl"
    # placeholder ids (no tokenizer here): bos, a word, the image token (4), a word
    asks.write_text(json.dumps({"prompt_ids": [2, 10, 4, 11], "images": ["a.png"],
                                "max_new_tokens": 2}))  # fmt: skip
    calibrate = ["verify", str(out), "--precision", "fp16", "--write-npi", "--prompts", str(asks)]
    assert main(calibrate) == 0
    report = capsys.readouterr().out
    assert "vision: 1 node(s) in float32" in report and "request 1 vision 1" in report, report
    assert read_npi(out / "vision.npi.yaml", graph) == ["sub_out_1"]
    (out / "vision.npi.yaml").unlink()
    asks.write_text(json.dumps({"prompt_ids": [2, 10, 11], "max_new_tokens": 2}))
    assert main(calibrate) == 2
    assert "no request in" in capsys.readouterr().err
    assert not (out / "vision.npi.yaml").exists()


def test_a_plan_made_layer_by_layer_names_the_whole_graphs_nodes(tmp_path, capsys, monkeypatch):
    """Token embeddings ×60 push one GELU product per decoder layer past float16 (the same
    node inside each layer function). The layer-by-layer search (a released size's way, here
    forced by --layerwise) runs one segment at a time, where onnx's inliner names a layer
    call's values "…__1"; its plan must name each layer's node as the whole graph does
    ("…__1" to "…__4") and equal the whole-graph plan. The plan is then honoured by a check
    in a spawned process, as a graph over the layer-by-layer threshold is checked."""
    t = default_tensors()
    name = "model.language_model.embed_tokens.weight"
    t[name] = (t[name].astype(np.float32) * 60).astype(ml_dtypes.bfloat16)
    save_checkpoint(tmp_path / "ckpt", DEFAULT_CONFIG, t)
    out = tmp_path / "out"
    export(ExportOptions(out=out, model=tmp_path / "ckpt", budgets=(70,), verify=False,
                         phases=("decode",)), log=lambda m: None)  # fmt: skip
    graph = onnx.load(out / "decode.onnx", load_external_data=False)
    plans, paired = [], []
    for way in ("--whole", "--layerwise"):
        args = ["verify", str(out), "--precision", "fp16", "--graph", "decode", way]
        assert main([*args, "--write-npi"]) == 0
        capsys.readouterr()
        plans.append(read_npi(out / "decode.npi.yaml", graph))
        paired.append(json.loads((out / "decode.npi.ref.json").read_text()))
        if way == "--layerwise":  # decode over the threshold: checked in a spawned process
            monkeypatch.setattr(verify_module, "LAYERWISE_BYTES", 0)
            pools = _counted_pools(monkeypatch)
        assert main(args) == 0  # the plan honoured, both device models finite
        assert "plan decode.npi.yaml: 4 node(s) in float32" in capsys.readouterr().out
    assert pools == [1], pools  # one child, which honoured the plan
    assert plans[0] == [f"gelu_mul_6__{k}" for k in range(1, 5)], plans
    assert plans[1] == plans[0]
    assert paired[1] == paired[0] and paired[0]["parted"] is None, paired
    # GELU's x³: the graph's (x·x)·x, ref's integer_pow, in each layer's own body
    assert [n["ref"] for n in paired[0]["nodes"]] == [
        f"layers.{k}:integer_pow#0" for k in range(4)
    ], paired


def _counted_pools(monkeypatch):
    """[processes of each pool `precision.isolated` opened], pools counted as they open."""
    real, pools = precision.ProcessPoolExecutor, []

    def counted(n, **kw):
        pools.append(n)
        return real(n, **kw)

    monkeypatch.setattr(precision, "ProcessPoolExecutor", counted)
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
    assert ref.pair("a", {}, ("sub_out_1", "Sub")) == "VisionModel:sub#0"
    assert ref.pair("a", {}, ("gelu_mul_6", "Mul")) == "VisionModel:integer_pow#0"
    assert ref.parted is None and seen == [(), ("VisionModel:sub#0",)]
    assert ref.pair("b", {}, ("add_out_3", "Add")) is None  # ref's first is an exp
    assert "b: the graph turns 'add_out_3' (Add) non-finite first, ref VisionModel:exp#0" in (
        ref.parted
    )
    assert ref.pair("b", {}, ("add_out_4", "Add")) is None and len(seen) == 3  # no more runs
    alone = RefPlan(lambda feed, keep: record("sub"))
    assert alone.pair("c", {}) is None and "the graph turns nothing" in alone.parted
