"""`layer_replay`: a plan's `ref` pairing replays a layer call of its last run only when the
call's inputs (by content) and the tensors the plan keeps in that layer are the same."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen.check.layer_replay import Replay, kept_in
from tests.util import examples


def test_the_layers_kept_tensors_are_its_own_and_its_submodules():
    keep = ["layers.1:mul#0", "layers.1.mlp:integer_pow#0", "layers.10:mul#0",
            "layers.1x:add#0", "VisionModel:sub#0"]  # fmt: skip
    assert kept_in("layers.1", keep) == ("layers.1.mlp:integer_pow#0", "layers.1:mul#0")
    assert kept_in("layers.10", keep) == ("layers.10:mul#0",)
    assert kept_in("layers.2", keep) == ()


@settings(max_examples=examples(20), deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([np.float32, np.float16, np.int32]))
def test_a_call_is_replayed_only_on_the_same_inputs_and_kept_tensors(seed, dtype):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 5)) * 100).astype(dtype)
    replay = Replay()
    key = replay.key("layers.0", [x, np.int32(7)], ["layers.1:mul#0"])
    replay.put(0, key, ["record"], (x + 1,))
    same = replay.key("layers.0", [x.copy(), np.int32(7)], ["layers.1:mul#0", "layers.2:a#0"])
    records, made = replay.get(0, same)
    assert records == ["record"] and np.array_equal(made[0], x + 1)
    assert replay.get(1, same) is None  # another call
    changed = x.copy()
    changed.reshape(-1)[rng.integers(x.size)] += 1
    assert replay.get(0, replay.key("layers.0", [changed, np.int32(7)], [])) is None
    assert replay.get(0, replay.key("layers.0", [x, np.int32(8)], [])) is None
    assert replay.get(0, replay.key("layers.0", [x.astype(np.float64), np.int32(7)], [])) is None
    assert replay.get(0, replay.key("layers.0", [x, np.int32(7)], ["layers.0:mul#0"])) is None
    assert replay.key("layers.0", [x, object()], []) is None


def test_results_past_the_limit_are_not_held():
    x = np.zeros(100, np.float32)  # 400 bytes
    replay = Replay(limit=1000)
    for k in range(3):
        replay.put(k, replay.key(f"layers.{k}", [x], []), [], (x, x[:10]))
    assert sorted(replay.calls) == [0, 1]  # 880 bytes held; a third call would pass 1000
    replay.put(0, replay.key("layers.0", [x], []), [], (x[:1],))  # replaced, not added
    replay.put(2, replay.key("layers.2", [x], []), [], (x,))
    assert sorted(replay.calls) == [0, 1, 2]
