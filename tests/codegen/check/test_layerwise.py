"""`verify` layer by layer (`codegen.check.layerwise`) on the embedded default model, forced on: its
verdict equals the whole-graph check's, and a graph bound to a wrong weight is named by layer
(vision tower, prefill and decode graphs).

The oracle of both paths is `ref` on the checkpoint's own bytes read by name; the corruption
tests edit only the exported .onnx (an initializer pointed at another tensor's bytes of the
same shape), so `ref` is untouched and onnxruntime computes with the wrong weight.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen import graphs
from codegen.__main__ import main
from codegen.check import head_slices, layerwise, segments
from codegen.check.verify import verify
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import default_checkpoint
from codegen.folder.opened import open_folder
from codegen.graphs import text_config
from codegen.graphs.decoder import cache_owners
from ref.attention import reference
from tests.util import layer_of, linked_copy, rebind, same_shape_pair
from weights import open_checkpoint

LAYERED = ("vision", "prefill", "decode")
DOWN_PROJ = {"vision": "mlp.down_proj.linear.weight"}  # the tower's clipped linears

# `ref`'s device model of the whole graph and of each layer alone: one program jitted whole and
# one per layer, whose float32 matmuls XLA may accumulate in another order, then rounded to
# float16. Measured on an AVX-512/AMX host (2026-12-07): a layer's peak 88.3125 against
# 88.5625 (4 float16 ulps), an output's error to float32 0.00745 against 0.00712; identical on
# the hosts before. A wrong layer or a wrong cache moves them by far more.
PEAK_ULPS = 2**-7  # relative: 8 float16 ulps
ERRORS = 1e-3


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """The default model's vision, prefill (blocked: query chunks × KV blocks) and decode
    (head-parallel KV blocks, skip_kv) graphs, one budget, with 3 cache slots."""
    model = default_checkpoint(tmp_path_factory.mktemp("cache") / "default")
    folder = tmp_path_factory.mktemp("exports") / "layered"
    rc = main(
        ["export", "--model", str(model), "--out", str(folder), "--budgets", "70"]
        + ["--prefill-blocking", "qkv:prefill_block_chunks=2,num_kv_blocks=2"]
        + ["--decode-blocking", "kv_headpar:num_kv_blocks=2,skip_kv=true"]
        + ["--full-batch-size", "3", "--no-verify"]
    )
    assert rc == 0
    return folder


def _bad(rows):
    return [r for r in rows if not r[-1]]


def test_layer_by_layer_gives_the_whole_graph_verdict(out, monkeypatch):
    """...with continuous batching (3 slots) too, each cache drawn when its layer is reached:
    each layer writes its slots' rows in place (before, the step took every slot's rows
    before the first layer, so all caches were drawn up front). No layer's output outlives
    it: as many jax arrays of the hidden width are alive after each graph's last layer as
    after its second (before, the decoder and the vision tower kept every layer's output for
    `hidden_states`: 21 MiB per 31B prefill layer, 1.3 GB by its last). The output head is
    read in vocabulary slices, as a released vocabulary is (50 of the default model's 256
    rows at a time: 6 slices), in the logits of prefill and decode: the same verdict."""
    import jax

    whole = verify(out, seed=2, layerwise_given=False)
    events, log = _cache_draws(monkeypatch)
    alive, plain = {}, layerwise.give_back

    def spy():  # after each layer
        plain()
        line = next(what for kind, what in reversed(events) if kind == "log")
        graph = line.removeprefix("verify ").split()[0].rstrip(":")
        width = widths[graph]
        hidden = [a for a in jax.live_arrays() if a.ndim >= 2 and a.shape[-1] == width]
        alive.setdefault(graph, []).append(len(hidden))

    config = open_checkpoint(out).config
    text, vision = text_config(config).hidden_size, config["vision_config"]["hidden_size"]
    widths = {"vision": vision, "prefill": text, "decode": text}
    monkeypatch.setattr(layerwise, "give_back", spy)
    sliced = _sliced_heads(monkeypatch)
    layered = verify(out, seed=2, layerwise_given=True, log=log)
    monkeypatch.undo()
    assert sum(sliced) == 2  # the logits of prefill (one budget) and decode
    assert alive.keys() == set(LAYERED), alive.keys()
    for graph, counts in alive.items():
        assert len(counts) > 2 and counts[-1] <= counts[1], (graph, counts)
    owners = cache_owners(text_config(open_checkpoint(out).config))
    assert _drawn_at_their_layers(events, owners) == ["prefill", "decode"]
    assert not _bad(whole) and not _bad(layered), _bad(whole) + _bad(layered)
    assert {r[:3] for r in whole} <= {r[:3] for r in layered}
    for g, _, o, _, _, where, _ in layered:
        if g in LAYERED and o == "layer outputs":
            assert where.startswith("layer "), (g, o, where)
    assert {(g, o) for g, _, o, *_ in layered} >= {(g, "layer outputs") for g in LAYERED}
    # the default for a tiny model is the whole graph; over the threshold, layer by layer
    from codegen.check import verify as v

    export = open_folder(out, check_shards=False)
    checkpoint = export.checkpoint
    for entry in export.manifest.graphs:
        spec = v.rebuild(entry, checkpoint)
        model = export.graph(entry)
        assert v.way(spec, entry, model, checkpoint) == "whole"
        assert v.way(spec, entry, model, checkpoint, False) == "whole"
        small = v.float32_bytes(spec, checkpoint) - 1
        monkeypatch.setattr(v, "LAYERWISE_BYTES", small)
        assert v.way(spec, entry, model, checkpoint) == "layers"
        monkeypatch.undo()


@pytest.fixture
def copy(out, tmp_path):
    """A copy of the export whose .onnx files a test may edit (shards hard-linked, unchanged)."""
    return linked_copy(out, tmp_path, LAYERED)


def _spy_bound(monkeypatch):
    """The checkpoint names of the weights each layer call was fed from `ref` (bound)."""
    calls, plain = [], segments.bound_weights

    def spy(seg, n_arrays, weights, *rest):
        seg2, bound = plain(seg, n_arrays, weights, *rest)
        inputs = seg.nodes[-1].input[n_arrays:]
        names = {x: n for x, (n, _) in zip(inputs, weights, strict=True)}
        made_by = {o: n for n in seg.nodes[:-1] for o in n.output}
        calls.append(
            (
                {names[x] for x in bound},
                {n for x, n in names.items() if x not in bound},
                {made_by[x].input[0] if x in made_by else x for x in inputs},
            )
        )
        return seg2, bound

    monkeypatch.setattr(segments, "bound_weights", spy)
    return calls


@pytest.mark.parametrize("graph", LAYERED)
def test_a_layer_bound_to_another_layers_weight_is_named(copy, graph, monkeypatch):
    model = onnx.load(copy / f"{graph}.onnx", load_external_data=False)
    target, source = same_shape_pair(model, DOWN_PROJ.get(graph, "mlp.down_proj.weight"))
    rebind(copy, graph, target.name, source.name)
    calls = _spy_bound(monkeypatch)
    rows = verify(copy, seed=3, check_shards=False, layerwise_given=True, graphs=[graph])
    # every weight read from `ref`'s bytes is fed `ref`'s array; the rebound one is not
    assert calls and all(not kept or kept == {target.name} for _, kept, _ in calls), calls
    assert sum(target.name in inits for *_, inits in calls) >= 1
    assert all(target.name not in bound for bound, *_ in calls)
    monkeypatch.undo()
    bad = _bad(rows)
    assert bad and {r[0] for r in rows} == {graph}, rows
    layer = f"layer {layer_of(target.name)} "
    wrong = [r for r in bad if r[2] == "layer outputs"]
    assert wrong and all(r[5].startswith(layer) for r in wrong), bad
    # the whole-graph check fails on the same graph
    assert _bad(verify(copy, seed=3, check_shards=False, graphs=[graph]))


def test_a_wrong_glue_weight_is_named_as_glue(copy):
    model = onnx.load(copy / "prefill.onnx", load_external_data=False)
    norms = [t.name for t in model.graph.initializer if t.name.endswith("layernorm.weight")]
    final = next(
        t.name for t in model.graph.initializer if t.name.endswith("language_model.norm.weight")
    )
    rebind(copy, "prefill", final, norms[0])
    rows = verify(copy, seed=4, check_shards=False, layerwise_given=True, graphs=["prefill"])
    bad = _bad(rows)
    assert [(r[0], r[2], r[5]) for r in bad] == [("prefill", "logits", "glue")], rows


def test_cli_prints_which_way_and_each_layer(out, capsys):
    assert main(["verify", str(out), "--layerwise", "--graph", "decode"]
                + ["--specialization", "decode"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "verify decode: layer by layer" in captured.err
    assert "  decode decode: 7 of 7 outputs ok, worst " in captured.err
    assert "decode: layer 0 (" in captured.err and "decode: layer 3 (" in captured.err
    assert "vision" not in captured.err + captured.out
    assert "worst at" in captured.out and "layer outputs" in captured.out
    assert main(["verify", str(out), "--graph", "nope"]) == 2
    assert "no graph 'nope'" in capsys.readouterr().err
    assert main(["verify", str(out), "--graph", "decode", "--specialization", "prefill_70"]) == 2
    assert "no specialization 'prefill_70'" in capsys.readouterr().err


def _sliced_heads(monkeypatch):
    """The output head read 50 rows at a time (the default model's 256 rows: 6 slices) →
    [whether each glue segment `segments.vocab_slices` looked at was sliced]."""
    monkeypatch.setattr(head_slices, "VOCAB_ROWS", 50)
    sliced, plan = [], segments.vocab_slices

    def spy(*args):
        found = plan(*args)
        sliced.append(found is not None)
        return found

    monkeypatch.setattr(segments, "vocab_slices", spy)
    return sliced


def test_precision_layer_by_layer_gives_the_whole_graph_report(out):
    """`verify --precision` layer by layer (device-model passes per segment and per layer
    call) against the whole-graph device model on the blocked prefill (query chunks × KV
    blocks, vision merge, retained state), KV inputs stored as float16: the same layers and
    peaks (the same operations on the same values) within PEAK_ULPS, the same ONNX peak, errors
    to float32 within ERRORS of each other (their float32 oracles differ: the exported
    composition jitted, the dense reference sliced)."""
    from codegen.check.precision import verify_precision

    runs = {
        given: verify_precision(
            out,
            "fp16",
            kv_dtype="fp16",
            seed=1,
            layerwise_given=given,
            graphs=["prefill"],
        )  # fmt: skip
        for given in (False, True)
    }
    assert [r["way"] for r in runs[True]] == ["layer by layer"]
    for whole, layered in zip(runs[False], runs[True], strict=True):
        assert whole["way"] == "whole graph"
        assert dict(whole["layers"]).keys() == dict(layered["layers"]).keys()
        peaks = dict(layered["layers"])
        for name, a in whole["layers"]:
            assert abs(a - peaks[name]) <= PEAK_ULPS * a, (name, a, peaks[name])
        assert abs(whole["onnx_max"] - layered["onnx_max"]) <= 1e-6 * whole["onnx_max"]
        assert whole["ref_nonfinite"] is layered["ref_nonfinite"] is None
        assert whole["onnx_nonfinite"] is layered["onnx_nonfinite"] is None
        for (o, a, b), (o2, c, d) in zip(whole["errors"], layered["errors"], strict=True):
            assert o == o2 and abs(a - c) <= ERRORS and abs(b - d) <= ERRORS, (o, a, b, c, d)
            assert 0 < max(a, b) < 3e-2 or o == "image_idx_output", (o, a, b)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The default model's prefill (blocked, no vision) and decode graphs without continuous
    batching: each layer reads its caches only as layer arguments (`GraphSpec.lazy`)."""
    model = default_checkpoint(tmp_path_factory.mktemp("cache1") / "default")
    folder = tmp_path_factory.mktemp("exports") / "single"
    opts = ExportOptions(
        out=folder, model=model, budgets=(), seq_len=32, ctx_len=128, verify=False,
        prefill_blocking=("qkv", {"prefill_block_chunks": 2, "num_kv_blocks": 2}),
        hash_shards=False,
    )  # fmt: skip
    export(opts, log=lambda line: None)
    return folder


def _cache_draws(monkeypatch):
    """Events [("draw", shape) or ("log", line)] of every `Drawn` input drawn, and a log."""
    events, draw = [], graphs.Drawn.value

    def spy(self):
        events.append(("draw", self.shape))
        return draw(self)

    monkeypatch.setattr(graphs.Drawn, "value", spy)
    return events, lambda line: events.append(("log", line))


def _drawn_at_their_layers(events, owners):
    """In the prefill and decode checks of a `verify` log (`_cache_draws`), every cache is
    drawn once, and when layer k is checked exactly those of the owners ≤ k have been
    → the names of the language graphs checked."""
    starts = [j for j, e in enumerate(events) if e[0] == "log" and e[1].startswith("verify ")]
    language = [j for j in starts if events[j][1].split()[1].rstrip(":") in ("prefill", "decode")]
    for a, b in zip(starts, [*starts[1:], len(events)], strict=True):
        drawn, checked = 0, []
        for kind, what in events[a + 1 : b]:
            if kind == "draw":
                drawn += 1
            elif ": layer " in what:  # not the specialization's verdict line
                k = int(what.split(": layer ")[1].split(" ")[0])
                assert a not in language or drawn == 2 * sum(i <= k for i in owners), (
                    events[a], what, drawn,
                )  # fmt: skip
                checked.append(k)
        want = 2 * len(owners) if a in language else 0
        assert drawn == want and checked == sorted(checked) and checked, (events[a], drawn)
    return [events[j][1].split()[1].rstrip(":") for j in language]


def test_each_cache_is_drawn_when_its_layer_is_reached(single, monkeypatch):
    """Without continuous batching (the blocked prefill) every cache is drawn once, just
    before its layer: when layer k is checked, exactly the caches of the cache-owning layers up
    to k have been drawn (before: all drawn with the sample, 10 GiB of float32 for the 31B at
    ctx 65,536), and the verdict is the whole graph's, also with every result of `ref` on disk
    while onnxruntime runs its layer (`layerwise.spilled`)."""
    monkeypatch.setattr(layerwise, "SPILL_BYTES", 0)
    events, log = _cache_draws(monkeypatch)
    # the decode graph without continuous batching is drawn layer by layer in the audit below
    layered = verify(single, seed=6, layerwise_given=True, log=log, graphs=["prefill"])
    owners = cache_owners(text_config(open_checkpoint(single).config))
    assert _drawn_at_their_layers(events, owners) == ["prefill"]
    whole = verify(single, seed=6, layerwise_given=False, graphs=["prefill"])
    assert not _bad(whole) and not _bad(layered), _bad(whole) + _bad(layered)
    assert {r[:3] for r in whole} <= {r[:3] for r in layered}


def test_precision_layer_by_layer_draws_caches_at_their_layers(single, monkeypatch):
    """`verify --precision` layer by layer on the decode graph without continuous batching
    (caches drawn inside the passes, the float32 outputs kept on disk past SPILL_BYTES) gives
    the whole-graph report: same layers, peaks within PEAK_ULPS, errors within ERRORS."""
    from codegen.check.precision import verify_precision

    monkeypatch.setattr(layerwise, "SPILL_BYTES", 0)
    events, log = _cache_draws(monkeypatch)
    layered, whole = (
        verify_precision(single, "fp16", kv_dtype="mxint8", seed=2, layerwise_given=given,
                         graphs=["decode"], log=log)[0]
        for given in (True, False)
    )  # fmt: skip
    owners = cache_owners(text_config(open_checkpoint(single).config))
    # three passes draw each cache, the whole-graph check once more; the device model of
    # `ref` (the last pass) draws a layer's caches as it reaches the layer
    draws = [j for j, e in enumerate(events) if e[0] == "draw"]
    assert len(draws) == 4 * 2 * len(owners)
    last = events[draws[4 * len(owners)] : draws[6 * len(owners) - 1] + 2]
    drawn = 0
    for kind, what in last:
        if kind == "draw":
            drawn += 1
        elif ": layer " in what:
            k = int(what.split(": layer ")[1].split(" ")[0])
            assert drawn == 2 * sum(i <= k for i in owners), (what, drawn, last)
    assert (layered["way"], whole["way"]) == ("layer by layer", "whole graph")
    assert dict(whole["layers"]).keys() == dict(layered["layers"]).keys()
    peaks = dict(layered["layers"])
    for name, a in whole["layers"]:
        assert abs(a - peaks[name]) <= PEAK_ULPS * a, (name, a, peaks[name])
    for (o, a, b), (o2, c, d) in zip(whole["errors"], layered["errors"], strict=True):
        assert o == o2 and abs(a - c) <= ERRORS and abs(b - d) <= ERRORS, (o, a, b, c, d)


@pytest.mark.parametrize("score_bytes", [1 << 28, 64])
def test_sliced_reference_attends_each_row_to_its_slot(score_bytes, monkeypatch):
    """With cache_rows (k, v hold F cache slots) the layer-by-layer reference attends row by
    row, each to its own slot, also cut into query slices: equal to the dense answer on the
    slots picked out by numpy indexing."""
    monkeypatch.setattr(layerwise, "SCORE_BYTES", score_bytes)
    rng = np.random.default_rng(3)
    b, f, h, hkv, s, t, d = 2, 4, 4, 2, 3, 8, 4
    q = rng.standard_normal((b, h, s, d)).astype(np.float32)
    k, v = (rng.standard_normal((f, hkv, t, d)).astype(np.float32) for _ in range(2))
    q_pos = np.array([[5, 6, 7], [2, 3, -1]], np.int32)
    kv_pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    rows = np.array([3, 1], np.int32)
    got = layerwise.sliced_reference(q, k, v, q_pos, kv_pos, cache_rows=rows, sliding_window=3)
    want = reference(q, k[rows], v[rows], q_pos, kv_pos, sliding_window=3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@settings(max_examples=12, deadline=None)
@given(s=st.integers(1, 11), per=st.integers(1, 4), groups=st.booleans(), jit=st.booleans())
def test_sliced_reference_is_the_dense_answer_slice_by_slice(s, per, groups, jit):
    """Queries cut into slices of `per` rows (SCORE_BYTES set so), S not always a multiple:
    equal to the unsliced dense answer, eager and jitted, with and without attention groups
    (bidirectional items), sliding window 3."""
    b, h, hkv, t, d = 2, 4, 2, 8, 4
    rng = np.random.default_rng([s, per])
    q = rng.standard_normal((b, h, s, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, t, d)).astype(np.float32) for _ in range(2))
    q_pos = np.sort(rng.integers(-1, t, (b, s)), axis=1).astype(np.int32)
    kv_pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    grp = {}
    if groups:
        grp = dict(q_group=rng.integers(-1, 2, (b, s)).astype(np.int32),
                   kv_group=rng.integers(-1, 2, (b, t)).astype(np.int32))  # fmt: skip
    old = layerwise.SCORE_BYTES
    layerwise.SCORE_BYTES = 4 * b * h * t * per
    try:
        fn = functools.partial(layerwise.sliced_reference, sliding_window=3, **grp)
        got = (jax.jit(fn) if jit else fn)(q, k, v, q_pos, kv_pos)
    finally:
        layerwise.SCORE_BYTES = old
    want = reference(q, k, v, q_pos, kv_pos, sliding_window=3, **grp)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_sliced_reference_checks_concrete_keys_inside_its_loop(monkeypatch):
    """Run eagerly (a layer too large to compile, `layer_buffers.Compiled`), the slices' loop
    reads concrete keys of more than `validate.CHUNK` values: checked there as anywhere (a NaN
    refused at its index), not a traced answer the check cannot read."""
    b, h, s, t, d = 1, 2, 4, (1 << 22) // 8 + 8, 8
    monkeypatch.setattr(layerwise, "SCORE_BYTES", 4 * b * h * t * 2)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, h, s, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, 1, t, d)), jnp.float32)
    q_pos = jnp.asarray(np.arange(s)[None] + t - s, jnp.int32)
    kv_pos = jnp.asarray(np.arange(t)[None], jnp.int32)
    got = layerwise.sliced_reference(q, k, k, q_pos, kv_pos)
    want = reference(q[:, :, :2], k, k, q_pos[:, :2], kv_pos)
    np.testing.assert_allclose(np.asarray(got[:, :, :2]), np.asarray(want), rtol=1e-6)
    with pytest.raises(ValueError, match=r"k\[0, 0, 9, 1\] = nan: expected finite values"):
        layerwise.sliced_reference(q, k.at[0, 0, 9, 1].set(jnp.nan), k, q_pos, kv_pos)


def test_sliced_reference_runs_one_slice_at_a_time_when_jitted(monkeypatch):
    """XLA's own memory plan of the jitted sliced reference (64 queries over 4,096 keys in 8
    slices of 0.5 MiB of scores) holds under 4 slices' scores of temporaries: the slices run
    one after another, not all at once (slices as a Python loop: 8.5 MiB, 17 slices' worth)."""
    b, h, s, t, d = 1, 4, 64, 4096, 16
    monkeypatch.setattr(layerwise, "SCORE_BYTES", 4 * b * h * t * 8)
    f32 = np.float32
    args = [jax.ShapeDtypeStruct(x, f32) for x in ((b, h, s, d), (b, 1, t, d), (b, 1, t, d))]
    args += [jax.ShapeDtypeStruct((b, s), np.int32), jax.ShapeDtypeStruct((b, t), np.int32)]
    compiled = jax.jit(layerwise.sliced_reference).lower(*args).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 4 * layerwise.SCORE_BYTES


def _resident_bytes(address):
    """Rss of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= address < hi
        elif inside and head[0] == "Rss:":
            return int(head[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's smaps")
def test_comparing_a_spilled_result_leaves_it_out_of_memory(tmp_path, monkeypatch):
    """`error` on a result `spilled` to disk hands back each compared chunk's pages: the
    mapping is not resident afterwards (it was all of it, 32 MiB, before), and the numbers
    are those of the same comparison in memory."""
    monkeypatch.setattr(layerwise, "SPILL_BYTES", 0)
    rng = np.random.default_rng(0)
    want = rng.standard_normal(1 << 23).astype(np.float32)
    got = want + np.float32(1e-3)
    mapped = layerwise.spilled(want, tmp_path)
    assert isinstance(mapped, np.memmap)
    address = mapped.ctypes.data
    assert layerwise.error(got, mapped, chunk=1 << 20) == layerwise.error(got, want)
    assert _resident_bytes(address) <= 2 * 4096
    np.testing.assert_array_equal(mapped, want)  # read again from the file
    assert _resident_bytes(address) >= want.nbytes - 2 * 4096
