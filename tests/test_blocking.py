"""BlockingConfig: QEfficient qaic_config parsing, validation errors, and block plans that cover
every index exactly once (oracle: plain enumeration)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref.blocking import MODES, BlockingConfig, ranges


@settings(max_examples=300)
@given(st.integers(1, 200), st.data())
def test_ranges_cover_each_index_once_and_last_takes_the_remainder(n, data):
    blocks = data.draw(st.integers(1, n))
    length = data.draw(st.integers(n, 2 * n))
    got = ranges(n, blocks, length)
    size = -(-length // blocks)
    assert [i for a, b in got for i in range(a, b)] == list(range(n))
    assert all(b - a == size for a, b in got[:-1])
    assert 0 < got[-1][1] - got[-1][0] <= size
    assert len(got) <= blocks


@settings(max_examples=200)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 6),
    st.sampled_from(["h", "hq", "hkv", "hqkv", "bhqkv", "prefill_online"]),
    st.data(),
)
def test_head_blocks_cover_every_query_head_once_within_its_kv_head(b, hkv, g, mode, data):
    h = hkv * g
    if mode == "prefill_online":
        size = data.draw(st.sampled_from([c for c in range(1, g + 1) if g % c == 0]))
        cfg = BlockingConfig(
            mode=mode, prefill_block_chunks=1, num_kv_blocks=1, prefill_n_rep_chunk=size
        )
    else:
        size = data.draw(st.sampled_from([c for c in range(1, h + 1) if c % g == 0 or g % c == 0]))
        counts = {"num_q_blocks": 1} if "q" in mode else {}
        counts |= {"num_kv_blocks": 1} if "kv" in mode else {}
        counts |= {"num_batch_blocks": 1} if "b" in mode else {}
        cfg = BlockingConfig(mode=mode, head_block_size=size, **counts)
    plan = cfg.plan(b, h, hkv, 3, 5)
    heads = [
        j * g + r
        for kv0, kv1, reps in plan.heads
        for j in range(kv0, kv1)
        for a, c in reps
        for r in range(a, c)
    ]
    assert sorted(heads) == list(range(h))
    assert all(
        (kv1 - kv0) * sum(c - a for a, c in reps) <= max(size, g) for kv0, kv1, reps in plan.heads
    )


def test_from_qaic_config_reads_qefficient_keys():
    qaic = {
        "blocking_mode": "kv_headpar",
        "num_kv_blocks": 4,
        "kv_blocking_headpar_split": 2,
        "batch_fold": True,
        "ctx_len": 64,
        "skip_kv": True,
        "prefill_blocking_mode": "online",
        "prefill_block_chunks": 8,
        "prefill_n_rep_chunk": None,
        "include_sampler": True,
    }
    decode = BlockingConfig.from_qaic_config(qaic)
    assert decode == BlockingConfig(
        mode="kv", num_kv_blocks=4, headpar_split=2, batch_fold=True, ctx_len=64, skip_kv=True
    )
    prefill = BlockingConfig.from_qaic_config(qaic, prefill=True)
    assert prefill.mode == "prefill_online"
    assert (prefill.prefill_block_chunks, prefill.prefill_n_rep_chunk) == (8, None)
    assert prefill.plan(1, 8, 2, 16, 64).heads == ((0, 1, ((0, 4),)), (1, 2, ((0, 4),)))
    assert (
        BlockingConfig.from_qaic_config(
            {"blocking_mode": "kv_headpar", "num_kv_blocks": 2, "num_cores": 16}
        )
        .plan(1, 2, 1, 1, 8)
        .split
        == 16
    )
    assert BlockingConfig.from_qaic_config({"ctx_len": 64}) is None
    assert BlockingConfig.from_qaic_config({"blocking_mode": "default"}) is None
    hqkv = BlockingConfig.from_qaic_config(
        {"blocking_mode": "hqkv", "num_kv_blocks": 2, "num_q_blocks": 3, "head_block_size": 2}
    )
    assert hqkv.axes == ("h", "q", "kv")
    with pytest.raises(ValueError, match="unknown blocking_mode 'diagonal'"):
        BlockingConfig.from_qaic_config({"blocking_mode": "diagonal"})


@pytest.mark.parametrize(
    ("kwargs", "shape", "message"),
    [
        (dict(mode="zigzag"), None, "unknown blocking mode 'zigzag'"),
        (dict(mode="kv"), None, "needs num_kv_blocks"),
        (dict(mode="kv", num_kv_blocks=0), None, "num_kv_blocks must be an int >= 1, got 0"),
        (dict(mode="kv", num_kv_blocks=2, num_q_blocks=2), None, "num_q_blocks=2 is not used"),
        (dict(mode="q", num_q_blocks=2, headpar_split=2), None, "headpar_split needs"),
        (dict(mode="kv", num_kv_blocks=2, headpar_split=-1), None, "headpar_split must be"),
        (
            dict(
                mode="bhqkv",
                num_batch_blocks=1,
                head_block_size=1,
                num_q_blocks=1,
                num_kv_blocks=1,
                batch_fold=True,
            ),
            None,
            "batch_fold",
        ),
        (dict(mode="prefill_q"), None, "needs prefill_block_chunks"),
        (dict(mode="kv", num_kv_blocks=9), (1, 2, 1, 4, 8), "more blocks than the 8"),
        (dict(mode="q", num_q_blocks=5), (1, 2, 1, 4, 8), "more blocks than the 4 queries"),
        (
            dict(
                mode="bhqkv", num_batch_blocks=3, head_block_size=1, num_q_blocks=1, num_kv_blocks=1
            ),
            (2, 2, 1, 4, 8),
            "more blocks than the 2 batch",
        ),
        (dict(mode="h", head_block_size=3), (1, 8, 2, 4, 8), "multiple or a divisor"),
        (dict(mode="h", head_block_size=16), (1, 8, 2, 4, 8), "more than the 8 query heads"),
        (
            dict(
                mode="prefill_online",
                prefill_block_chunks=1,
                num_kv_blocks=1,
                prefill_n_rep_chunk=3,
            ),
            (1, 8, 2, 4, 8),
            "must divide the GQA group size 4",
        ),
        (dict(mode="kv", num_kv_blocks=2, ctx_len=6), (1, 2, 1, 4, 8), "ctx_len=6 is shorter"),
        (dict(mode="kv", num_kv_blocks=2), (1, 6, 4, 4, 8), "multiple of kv heads"),
    ],
)
def test_impossible_configs_fail_with_clear_errors(kwargs, shape, message):
    with pytest.raises(ValueError, match=message):
        cfg = BlockingConfig(**kwargs)
        cfg.plan(*shape)


def test_every_mode_has_a_plan():
    options = dict(
        num_kv_blocks=2,
        num_q_blocks=2,
        head_block_size=2,
        num_batch_blocks=2,
        prefill_block_chunks=2,
    )
    for mode in MODES:
        probe = BlockingConfig.from_qaic_config(
            {
                "prefill_blocking_mode"
                if mode.startswith("prefill_")
                else "blocking_mode": mode.removeprefix("prefill_"),
                **options,
            },
            prefill=mode.startswith("prefill_"),
        )
        assert probe.mode == mode
        plan = probe.plan(2, 4, 2, 4, 8)
        assert plan.q[-1][1] == 4 and plan.kv[-1][1] == 8 and plan.batch[-1][1] == 2
