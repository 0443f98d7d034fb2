"""The exported `audio` graph: a tiny Gemma 4 with an audio tower saved by transformers, exported
with only its audio graph (budgets 20 and 50 soft tokens, 3 clips a call), runs in onnxruntime
on drawn clips packed into a budget and gives `ref`'s `AudioTower.embed` of the same clips, each
clip's soft tokens at its offset (`verify` checked the whole graph at every specialization on
random packings during the export); its ops are on the QAIC allow-list (the export's check);
a checkpoint without audio exports no audio graph; bad budgets are refused, naming the value.
`verify` layer by layer (`codegen.check.layerwise`: the subsampling as glue, each AudioLayer call
alone on `ref`'s inputs) gives the whole graph's verdict, and names the layer whose weight the
graph reads from another layer's bytes.
`verify --precision` runs the device model on it (docs/precision.md, "Audio"): finite in float16
and bfloat16 on drawn clips; a checkpoint built to overflow an RMSNorm's x·x is named there by
both device models, and the plan `--write-npi` writes keeps it.

Tolerance: max |ort − ref| / max |ref| ≤ 1e-5 in float32 (measured 4e-7).
"""

import re

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.__main__ import main
from codegen.check import verify as v
from codegen.export.command import ExportOptions, export
from codegen.export.options import ExportError
from codegen.folder.opened import open_folder
from codegen.folder.sessions import open_session, read_manifest
from codegen.graphs.audio import FRAMES_PER_TOKEN
from ref.gemma4.audio_packing import pack, pack_frames
from ref.gemma4.audio_tower import AudioTower
from tests.hf_audio import TINY_AUDIO
from tests.text_oracle import hf_model, text_config
from tests.util import (
    examples,
    folder_copy,
    layer_of,
    linked_copy,
    rebind,
    rel_err,
    same_shape_pair,
)
from weights.safetensors import read_header

RTOL = 1e-5
ONE = ["audio_20"]  # the specialization checked layer by layer
BUDGETS, CLIPS = (20, 50), 3
TWO_LAYERS = dict(TINY_AUDIO, num_hidden_layers=2)


def _options(out, model, **kw):
    return ExportOptions(out=out, model=model, graphs=("attention",), blocking=(), budgets=(),
                         hash_shards=False, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(ref AudioTower, export folder, its manifest) of a randomized tiny model with audio."""
    text = text_config(moe=False, layer_types=["sliding_attention", "full_attention"], ple=8)
    model = hf_model(text, seed=5, audio=TWO_LAYERS)
    folder = tmp_path_factory.mktemp("audio-model")
    model.save_pretrained(folder)
    out = tmp_path_factory.mktemp("audio-export") / "out"
    manifest, _ = export(
        _options(out, folder, audio_budgets=BUDGETS, audio_clips=CLIPS), log=lambda m: None
    )
    return AudioTower.from_pretrained(folder), out, manifest


def test_only_the_audio_graph_with_a_specialization_per_budget(exported):
    _, _, manifest = exported
    (graph,) = manifest.graphs
    assert (graph.name, graph.kind) == ("audio", "audio")
    assert [s["name"] for s in graph.specializations] == ["audio_20", "audio_50"]
    assert [s["symbols"]["num_frames"] for s in graph.specializations] == [80, 200]


@settings(max_examples=examples(4), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    frames=st.lists(st.integers(1, 66), min_size=1, max_size=CLIPS),
    seed=st.integers(0, 2**31 - 1),
)
def test_onnxruntime_equals_ref_on_packed_clips(exported, frames, seed):
    tower, out, manifest = exported
    (graph,) = manifest.graphs
    rng = np.random.default_rng(seed)
    clips = [rng.standard_normal((n, 128)).astype(np.float32) for n in frames]
    budget = next(b for b in BUDGETS if FRAMES_PER_TOKEN * b >= sum(frames))
    packing = pack(frames, tower.config, frame_budget=FRAMES_PER_TOKEN * budget, max_clips=CLIPS)
    session = open_session(graph, out, read_manifest(out, check_shards=False))
    got = session.run(None, {"frames": pack_frames(clips, packing), **packing.arrays})[0]
    want, counts = tower.embed(clips)
    assert counts == packing.token_counts
    assert rel_err(got[: packing.num_real_tokens], want) <= RTOL


def _overwrite(folder, new):
    """Overwrite tensors of the export `folder`'s shards in place: new[name](its values as
    float32) stored in its own dtype, at its own byte range."""
    for shard in sorted(folder.glob("*.safetensors")):
        for name, info in read_header(shard).items():
            if name in new:
                with open(shard, "r+b") as f:
                    f.seek(info.offset)
                    values = np.frombuffer(f.read(info.nbytes), info.np_dtype)
                    f.seek(info.offset)
                    f.write(np.asarray(new[name](values.astype(np.float32)), info.np_dtype))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_verify_precision_keeps_the_audio_graph_finite(exported, capsys, precision):
    """Drawn clips with filler chunks, whose rows hide every key (transformers' −1e9 fill is
    −inf in float16, and those rows' softmax was NaN), through clamps whose bound, 1e10, is
    beyond float16 (it read as an overflow in ref's device model)."""
    _, out, _ = exported
    assert main(["verify", str(out), "--precision", precision, "--specialization", "audio_20"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^audio +audio_20 +layers\.1 ", text, re.M)  # the device model ran on it
    assert "no tensor of the graphs leaves the" in text


FFW_2 = "model.audio_tower.layers.0.feed_forward1.ffw_layer_2."


def test_verify_precision_names_an_rms_norm_overflow_and_the_plan_keeps_it(
    exported, tmp_path, capsys
):
    """Layer 0's first ffw_layer_2 ×500 with its output bounds at ±60,000: its outputs (~10³)
    fit float16, and the gradient_clipping clamp after it (1e10) bounds nothing, so
    post_layer_norm's x·x passes 65,504. Both device models name that product in layer 0; the
    plan keeps it in both AudioLayer calls, with the mean of squares and its + eps, and both
    stay finite with it (ref's side does not part from the graph's)."""
    _, out, _ = exported
    copy = folder_copy(out, tmp_path)
    _overwrite(copy, {FFW_2 + "linear.weight": lambda w: 500 * w,
                      FFW_2 + "output_min": lambda b: b * 0 - 6e4,
                      FFW_2 + "output_max": lambda b: b * 0 + 6e4})  # fmt: skip
    args = ["verify", str(copy), "--precision", "fp16", "--specialization", "audio_20"]
    assert main(args) == 1
    text = capsys.readouterr().out
    assert "ref: mul [22, 16] in layers.0.feed_forward1.post_layer_norm turns non-finite" in text
    assert "onnx: tensor 'AudioLayer/mul_out_3__1' (Mul of 'AudioLayer/clip_out_5__1'" in text
    assert main([*args, "--write-npi"]) == 0
    plan = capsys.readouterr().out
    assert "audio: 3 node(s) in float32 (6 in all calls)" in plan
    kept = ("AudioLayer/mul_out_3 (Mul) in each of AudioLayer's 2 call(s) = ref "
            "layers.0.feed_forward1.post_layer_norm:mul#0, "
            "layers.1.feed_forward1.post_layer_norm:mul#0")  # fmt: skip
    assert kept in plan and "ref parts" not in plan
    assert (copy / "audio.npi.yaml").exists()


def test_no_audio_graph_without_an_audio_tower(tmp_path):
    text = text_config(moe=False, layer_types=["sliding_attention", "full_attention"], ple=8)
    folder = tmp_path / "model"
    hf_model(text, seed=1).save_pretrained(folder)
    opts = _options(tmp_path / "out", folder, audio_budgets=BUDGETS)
    with pytest.raises(ExportError, match="nothing to export"):
        export(opts, log=lambda m: None)


@pytest.mark.parametrize(
    "budgets, clips, message",
    [
        ((751,), 4, "audio budget 751: expected an int in \\[1, 750\\]"),
        ((0,), 4, "audio budget 0"),
        ((20, 20), 4, "repeat a value"),
        ((20,), 0, "audio clips 0: expected an int >= 1"),
    ],
)
def test_bad_audio_budgets_are_refused(tmp_path, budgets, clips, message):
    with pytest.raises(ExportError, match=message):
        ExportOptions(out=tmp_path, audio_budgets=budgets, audio_clips=clips).validate()


def _bad(rows):
    return [r for r in rows if not r[-1]]


def test_layer_by_layer_gives_the_whole_graph_verdict(exported, monkeypatch):
    _, out, _ = exported
    whole = v.verify(out, seed=2, check_shards=False, layerwise_given=False, specializations=ONE)
    lines = []
    layered = v.verify(out, seed=2, check_shards=False, layerwise_given=True,
                       specializations=ONE, log=lines.append)  # fmt: skip
    assert not _bad(whole) and not _bad(layered), _bad(whole) + _bad(layered)
    assert [r[2] for r in layered] == ["audio_embeds", "layer inputs", "layer outputs"]
    assert [r[5] for r in whole] == ["whole graph"] and layered[2][5].startswith("layer ")
    assert sum("(AudioLayer) checked" in line for line in lines) == TWO_LAYERS["num_hidden_layers"]
    # a tiny tower is checked whole by default; over the threshold, layer by layer
    export = open_folder(out, check_shards=False)
    checkpoint, (entry,) = export.checkpoint, export.manifest.graphs
    spec = v.rebuild(entry, checkpoint)
    model = export.graph(entry)
    assert v.way(spec, entry, model, checkpoint) == "whole"
    monkeypatch.setattr(v, "LAYERWISE_BYTES", v.float32_bytes(spec, checkpoint) - 1)
    assert v.way(spec, entry, model, checkpoint) == "layers"


def test_a_layer_bound_to_another_layers_weight_is_named(exported, tmp_path):
    _, out, _ = exported
    copy = linked_copy(out, tmp_path, ["audio"])
    model = onnx.load(copy / "audio.onnx", load_external_data=False)
    target, source = same_shape_pair(model, "feed_forward1.ffw_layer_2.linear.weight")
    rebind(copy, "audio", target.name, source.name)
    rows = v.verify(copy, seed=2, check_shards=False, layerwise_given=True, specializations=ONE)
    where = f"layer {layer_of(target.name)} (AudioLayer)"
    assert [(r[2], r[5]) for r in _bad(rows)] == [("layer outputs", where)], rows
