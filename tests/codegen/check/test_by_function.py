"""`verify` by layer function (`codegen.check.by_function`, `codegen.check.bindings`) on a tiny
text model whose 4 layers call 2 functions (sliding, full; no KV sharing): it passes on the
export as written and fails, naming the call, on each fault it exists to catch, made by editing
the exported prefill graph with the onnx API (the checkpoint and `ref` untouched).

The oracles: the proof's is `ref`'s composition traced (which weight, input and earlier result
each layer takes) and the safetensors headers; the numerics' is `ref` with the layer's real
weights, as layer by layer. This model computes RoPE inside each layer from the positions and
its kind's static frequencies, so the per-kind tables a call is given as inputs are its masks:
the "sliding call given the full layer's table" fault is a mask input rebound.
"""

import copy as copying
import dataclasses
import os

import jax
import numpy as np
import onnx
import pytest
from onnx import helper

from codegen import graphs
from codegen.__main__ import main
from codegen.check import by_function
from codegen.check import verify as v
from codegen.check.verify import opened, verify
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import DEFAULT_CONFIG, default_side_files, default_tensors
from tests.util import layer_of, linked_copy
from weights import save_checkpoint

SLIDING, FULL = "SlidingDecoderLayer", "FullDecoderLayer"


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """The prefill graph of 4 text layers (sliding, full, sliding, full)."""
    config = copying.deepcopy(DEFAULT_CONFIG)
    config["text_config"]["num_kv_shared_layers"] = 0
    model = tmp_path_factory.mktemp("model") / "m"
    save_checkpoint(model, config, default_tensors(config))
    for name, text in default_side_files().items():
        (model / name).write_text(text)
    folder = tmp_path_factory.mktemp("exports") / "two_functions"
    opts = ExportOptions(out=folder, model=model, budgets=(), seq_len=16, ctx_len=64,
                         phases=("prefill",), verify=False, hash_shards=False)  # fmt: skip
    export(opts, log=lambda line: None)
    return folder


@pytest.fixture
def copy(out, tmp_path):
    return linked_copy(out, tmp_path, ["prefill"])


def _load(folder):
    return onnx.load(os.path.join(folder, "prefill.onnx"), load_external_data=False)


def _save(folder, model):
    path = os.path.join(folder, "prefill.onnx")
    onnx.save(model, path + ".tmp")
    os.replace(path + ".tmp", path)


def _calls(model):
    """[(index among the layer calls, node)] of the graph's layer calls."""
    functions = {f.name for f in model.functions}
    return list(enumerate(n for n in model.graph.node if n.op_type in functions))


def _verify(folder, seed=0):
    """(rows, log lines) of verify by layer function of the prefill graph."""
    lines = []
    rows = verify(folder, seed=seed, check_shards=False, graphs=["prefill"], calls="one",
                  log=lines.append)  # fmt: skip
    return rows, lines


def _proof_fault(folder):
    """The bindings row's `where` (its first fault), asserting it is the only row and failed."""
    rows, _ = _verify(folder)
    assert [(r[2], r[-1]) for r in rows] == [("bindings", False)], rows
    return rows[0][5]


def test_passes_as_exported_naming_the_calls_checked(out, capsys, monkeypatch):
    """The CLI checks one call per function, chosen by --seed and named, and proves the
    bindings; by default a graph over BY_FUNCTION_BYTES that calls a function more than once
    goes by function (layer by layer below it, or with BY_DEFAULT off), --exhaustive layer by
    layer."""
    assert main(["verify", str(out), "--by-function", "--graph", "prefill", "--seed", "3",
                 "--skip-shard-check"]) == 0  # fmt: skip
    text = capsys.readouterr()
    assert "prefill: by layer function" in text.err and "(seed 3)" in text.err, text.err
    assert "4 calls of 2 functions bound as ref binds them" in text.out, text.out
    picked = by_function.chosen_calls(_load(out), 3, "prefill")
    assert sorted(picked) == [FULL, SLIDING] and picked[SLIDING] % 2 == 0 == picked[FULL] % 2 - 1
    checked = [f"layer {k} ({fn}) checked" for fn, k in picked.items()]
    assert all(c in text.err for c in checked) and text.err.count(") checked,") == 2, text.err
    folder, checkpoint, chosen = opened(out, False, ["prefill"])
    entry, spec, model = chosen[0]
    monkeypatch.setattr(v, "LAYERWISE_BYTES", 0)
    assert v._ways(spec, entry, model, checkpoint, None, None) == "layers"  # under 256 MiB
    monkeypatch.setattr(by_function, "BY_FUNCTION_BYTES", 0)
    assert v._ways(spec, entry, model, checkpoint, None, None) == "functions"
    monkeypatch.setattr(by_function, "BY_DEFAULT", False)
    assert v._ways(spec, entry, model, checkpoint, None, None) == "layers"
    monkeypatch.setattr(by_function, "BY_DEFAULT", True)
    assert v._ways(spec, entry, model, checkpoint, None, "every") == "layers"
    assert v._ways(spec, entry, model, checkpoint, False, None) == "whole"


def _initializers(model, needle):
    return {layer_of(t.name): t for t in model.graph.initializer if t.name.endswith(needle)}


def test_two_layers_weights_swapped(copy):
    model = _load(copy)
    q = _initializers(model, "self_attn.q_proj.weight")
    a, b = list(q[0].external_data), list(q[2].external_data)
    del q[0].external_data[:], q[2].external_data[:]
    q[0].external_data.extend(b)
    q[2].external_data.extend(a)
    _save(copy, model)
    where = _proof_fault(copy)
    assert where.startswith("call 0 (SlidingDecoderLayer) input ") and q[2].name in where, where


def test_an_offset_off_by_one_tensor(copy):
    model = _load(copy)
    placed = sorted(
        (int({e.key: e.value for e in t.external_data}["offset"]), t)
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    )
    k = next(i for i, (_, t) in enumerate(placed) if ".layers.1." in t.name)
    target, after = placed[k][1], placed[k + 1][0]
    for e in target.external_data:
        if e.key == "offset":
            e.value = str(after)
    _save(copy, model)
    where = _proof_fault(copy)
    assert where.startswith("call 1 (FullDecoderLayer) input ") and target.name in where, where


def test_a_cache_input_bound_to_another_layer(copy):
    model = _load(copy)
    _, call = _calls(model)[2]
    j = list(call.input).index("past_key.2")
    call.input[j] = "past_key.0"
    _save(copy, model)
    where = _proof_fault(copy)
    assert where == (f"call 2 (SlidingDecoderLayer) input {j}: ref binds input 'past_key.2', "
                     "the graph input 'past_key.0'"), where  # fmt: skip


def _kind_only(calls, fn, other):
    """Glue values every call of `fn` reads and no call of `other` does (its kind's tables)."""
    mine = set.intersection(*[set(c.input) for _, c in calls if c.op_type == fn])
    theirs = set.union(*[set(c.input) for _, c in calls if c.op_type == other])
    return sorted(x for x in mine - theirs if not x.startswith("model.") and "." not in x)


def test_a_sliding_call_given_the_full_layers_table(copy):
    model = _load(copy)
    calls = _calls(model)
    sliding, full = _kind_only(calls, SLIDING, FULL), _kind_only(calls, FULL, SLIDING)
    assert sliding and full, (sliding, full)
    _, call = calls[2]
    j = list(call.input).index(sliding[-1])
    call.input[j] = full[-1]
    _save(copy, model)
    where = _proof_fault(copy)
    assert where.startswith(f"call 2 (SlidingDecoderLayer) input {j}: glue value"), where


def test_a_body_bug_in_every_call_is_named_at_the_call_checked(copy):
    """The full function's first result scaled by 1 + 1e-3 inside its body: every call has
    it, the proof (bindings only) holds, the one full call checked fails."""
    model = _load(copy)
    body = next(f for f in model.functions if f.name == FULL)
    result = body.output[0]
    maker = next(n for n in body.node if result in n.output)
    maker.output[list(maker.output).index(result)] = "unscaled"
    scale = helper.make_tensor("scale", onnx.TensorProto.FLOAT, [], [1.001])
    body.node.extend([
        helper.make_node("Constant", [], ["bug_scale"], value=scale),
        helper.make_node("Mul", ["unscaled", "bug_scale"], [result]),
    ])  # fmt: skip
    _save(copy, model)
    rows, _ = _verify(copy, seed=1)
    picked = by_function.chosen_calls(model, 1, "prefill")
    assert rows[0][2:] == ("bindings", 0.0, 0.0, rows[0][5], True), rows[0]
    bad = [r for r in rows if not r[-1]]
    assert bad and {r[5] for r in bad if r[2] == "layer outputs"} == {
        f"layer {picked[FULL]} ({FULL})"
    }, rows
    assert all(np.isfinite(r[3]) for r in rows)


def test_a_glue_bug_feeding_a_call_not_checked_is_named_at_its_input(copy):
    """The per-layer input of a call the seed does not pick scaled by 1 + 1e-3 in the glue:
    the proof (where values come from) holds; the inputs of every call, checked or stood
    in for, are compared with `ref`'s, so that call's input is named."""
    model = _load(copy)
    picked = by_function.chosen_calls(model, 1, "prefill")
    k, call = next((k, c) for k, c in _calls(model) if k not in picked.values())
    j = 1  # the layer's per-layer input (`DecoderLayer.__call__`'s second argument)
    scale = helper.make_tensor("bug_scale", onnx.TensorProto.FLOAT, [], [1.001])
    model.graph.initializer.append(scale)
    model.graph.node.insert(
        list(model.graph.node).index(call),
        helper.make_node("Mul", [call.input[j], "bug_scale"], ["bug_input"]),
    )
    call.input[j] = "bug_input"  # fmt: skip
    _save(copy, model)
    rows, _ = _verify(copy, seed=1)
    assert rows[0][-1], rows[0]
    bad = [(r[2], r[5]) for r in rows if not r[-1]]
    assert bad == [("layer inputs", f"layer {k} ({call.op_type}) input {j}")], rows


def test_a_stood_in_hidden_state_is_its_input_plus_the_draw():
    """A stood-in call's first float32 result shaped as its first input is that input plus
    the standard normal draw of (seed, 1 + call, result) (numpy's generator as the oracle);
    a call whose first input is a drawn cache, or not float32, gets plain draws."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((1, 5, 8)).astype(np.float32) * 30
    cache = graphs.Drawn((1, 2, 16, 4), (9,))
    avals = [jax.ShapeDtypeStruct((1, 2, 16, 4), np.float32),
             jax.ShapeDtypeStruct((1, 5, 8), np.float32)]  # fmt: skip
    assert by_function.residual(avals, [hidden, cache]) == 1
    assert by_function.residual(avals, [cache, hidden]) is None
    assert by_function.residual(avals, [hidden.astype(np.int32)]) is None
    assert by_function.residual(avals[:1], [hidden]) is None
    got = graphs.Drawn((1, 5, 8), (7, 4, 1), then=by_function.Plus(hidden.copy())).value()
    want = hidden + np.random.default_rng((7, 4, 1)).standard_normal((1, 5, 8), np.float32)
    np.testing.assert_array_equal(got, want)


def test_a_function_is_checked_once_per_input_shapes(out):
    """A graph's specializations whose layer calls take inputs of the same shapes (prefill's
    image budgets share seq_len) check each function's chosen call at the first only: at a
    second specialization of the same shapes every call is stood in for, its glue and the
    calls' inputs still compared, every row ok."""
    folder, checkpoint, chosen = opened(out, False, ["prefill"])
    _, spec, model = chosen[0]
    twice = dataclasses.replace(spec, specializations=spec.specializations * 2)
    picked = by_function.chosen_calls(model, 2, "prefill")
    lines = []
    rows = v._layered(twice, model, folder, checkpoint, 2, lines.append, picked)
    checked = [x for x in lines if ") checked," in x]
    again = [x for x in lines if "stood in: checked on inputs of these shapes" in x]
    assert len(checked) == 2 == len(again), lines
    assert {f"layer {k} ({fn})" for fn, k in picked.items()} == {
        x.split(": ")[1].split(" checked")[0] for x in checked
    }
    assert rows and all(r[-1] for r in rows), rows
    second = [r for r in rows[len(rows) // 2 :] if r[1] == "layer inputs"]
    assert second, rows
