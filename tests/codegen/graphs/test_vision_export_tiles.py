"""The exported vision graph attends tile by tile: one graph (symbolic num_patches) whose
query × KV tiles divide every budget's patches; onnxruntime on it equals the `ref` tower
(attending per item, not by tiles) ≤ 1e-5 at each specialization, for drawn tiles and packings."""

from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from codegen import graphs
from codegen.check.structure import allowed_ops, no_unclamped_dynamic_slice
from codegen.graphs import GraphError
from codegen.graphs.vision import cu_seqlens, vision_graph
from codegen.lower.trace import trace
from ref.gemma4.config import VisionConfig
from ref.gemma4.params import vision_param_shapes
from tests.util import examples

CONFIG = VisionConfig(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    patch_size=1,
    position_embedding_size=64,
)


def _hf(cfg):
    fields = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "text_hidden_size"}
    fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    return fields


def _weights(rng):
    return {
        n: (rng.standard_normal(s) * 0.5).astype(np.float32)
        for n, s in vision_param_shapes(CONFIG).items()
    }


# Tile counts dividing 630 (budget 70's patches), few enough to trace in a few seconds; no
# shrinking (each example traces a graph): a failure reports the tiles and seed as drawn.
@settings(max_examples=examples(2), phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(st.sampled_from([1, 2, 3, 5]), st.sampled_from([1, 2, 3, 5]), st.integers(0, 2**32 - 1))
def test_tiled_vision_graph_in_onnxruntime_equals_ref(q_tiles, kv_tiles, seed):
    shapes = vision_param_shapes(CONFIG)
    spec = vision_graph(_hf(CONFIG), shapes, (70, 140), tiles=(q_tiles, kv_tiles))
    assert spec.options["tiles"] == [q_tiles, kv_tiles]
    no_unclamped_dynamic_slice(spec, shapes)  # as the export does, which registers the layer
    model = trace(spec, {n: SimpleNamespace(shape=s) for n, s in shapes.items()})
    allowed_ops(model)
    assert model.functions and "Loop" not in {n.op_type for n in model.functions[0].node}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    weights = _weights(rng)
    for s in spec.specializations:
        feed = spec.sample(s["symbols"], rng)
        got = session.run(None, feed | weights)[0]
        with graphs.layer_scope():
            want = spec.reference(feed, weights)["pooled"]
        assert got.shape == want.shape == (s["symbols"]["vision_size"], CONFIG.hidden_size)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize(
    ("tiles", "budgets", "words"),
    [
        ((4, 1), (70,), ["4 query tiles", "num_patches 630 (budget 70)", "[1, 2, 3, 5, 6, 7"]),
        ((1, 8), (140,), ["8 KV tiles", "num_patches 1260 (budget 140)"]),
        ((0, 1), (70,), ["vision tiles [0, 1]", "two ints >= 1"]),
        ((2,), (70,), ["vision tiles [2]"]),
    ],
)
def test_tiles_that_do_not_divide_are_refused(tiles, budgets, words):
    with pytest.raises(GraphError) as e:
        vision_graph(_hf(CONFIG), vision_param_shapes(CONFIG), budgets, tiles=tiles)
    for w in words:
        assert w in str(e.value)


def test_cu_seqlens_of_packed_segment_ids():
    assert cu_seqlens(np.array([0, 0, 1, 1, 1, -1], np.int32)) == (0, 2, 5)
    assert cu_seqlens(np.array([0, 0, 0], np.int32)) == (0, 3)
    with pytest.raises(GraphError, match="not items 0, 1"):
        cu_seqlens(np.array([1, 1, 0, -1], np.int32))
