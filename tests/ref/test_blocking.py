"""BlockingConfig: QEfficient qaic_config parsing, validation errors, and block plans that cover
every index exactly once (oracle: plain enumeration)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ref.blocking import MODES, BlockingConfig
from ref.blocking_plan import Plan, ranges
from tests.util import examples


@settings(max_examples=examples(300))
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


@settings(max_examples=examples(200))
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


def test_plans_exact():
    """Whole plans checked by hand: block boundaries, GQA head blocks, flags, split defaults."""
    hqkv = BlockingConfig(mode="hqkv", head_block_size=2, num_q_blocks=2, num_kv_blocks=3)
    assert hqkv.plan(2, 8, 2, 5, 10) == Plan(
        batch=((0, 2),),
        heads=((0, 1, ((0, 2), (2, 4))), (1, 2, ((0, 2), (2, 4)))),
        q=((0, 3), (3, 5)),
        kv=((0, 4), (4, 8), (8, 10)),
        split=1,
        parallel=False,
        skip_kv=False,
        batch_fold=False,
        ordered=False,
    )
    bhqkv = BlockingConfig(
        mode="bhqkv",
        num_batch_blocks=2,
        head_block_size=8,
        num_q_blocks=1,
        num_kv_blocks=2,
        ctx_len=12,
    )
    assert bhqkv.plan(3, 8, 2, 5, 10) == Plan(
        batch=((0, 2), (2, 3)),
        heads=((0, 2, ((0, 4),)),),
        q=((0, 5),),
        kv=((0, 6), (6, 10)),
        split=1,
        parallel=False,
        skip_kv=False,
        batch_fold=False,
    )
    folded = BlockingConfig(
        mode="kv", num_kv_blocks=2, headpar_split=0, batch_fold=True, skip_kv=True, ordered=True
    )
    # Folded: batch 2 × 4 heads / 2 kv heads → 8 heads over 4 kv rows; split = num_devices.
    assert folded.plan(2, 4, 2, 3, 6, num_devices=3) == Plan(
        batch=((0, 1),),
        heads=((0, 4, ((0, 2),)),),
        q=((0, 3),),
        kv=((0, 3), (3, 6)),
        split=3,
        parallel=True,
        skip_kv=True,
        batch_fold=True,
        ordered=True,
    )
    prefill = BlockingConfig(
        mode="prefill_qkv", prefill_block_chunks=2, num_kv_blocks=2, prefill_n_rep_chunk=2
    )
    assert prefill.plan(1, 8, 2, 5, 6, num_devices=3) == Plan(
        batch=((0, 1),),
        heads=((0, 1, ((0, 2), (2, 4))), (1, 2, ((0, 2), (2, 4)))),
        q=((0, 3), (3, 5)),
        kv=((0, 3), (3, 6)),
        split=1,
        parallel=True,
        skip_kv=False,
        batch_fold=False,
    )
    online = BlockingConfig(mode="prefill_online", prefill_block_chunks=3, num_kv_blocks=1)
    plan = online.plan(1, 4, 4, 7, 6)
    assert plan.heads == tuple((j, j + 1, ((0, 1),)) for j in range(4))
    assert (plan.q, plan.kv, plan.parallel) == (((0, 3), (3, 6), (6, 7)), ((0, 6),), False)
    split = BlockingConfig(mode="qkv", num_q_blocks=1, num_kv_blocks=1, headpar_split=2)
    assert (split.plan(1, 2, 1, 1, 4, num_devices=5).split, split.axes) == (2, ("q", "kv"))
    cores = BlockingConfig(mode="hkv", head_block_size=1, num_kv_blocks=1, headpar_split=0)
    assert cores.plan(1, 2, 1, 1, 4, num_devices=5).split == 5
    with_cores = BlockingConfig(mode="kv", num_kv_blocks=1, headpar_split=0, num_cores=7)
    assert with_cores.plan(1, 2, 1, 1, 4, num_devices=5).split == 7
    assert ranges(10, 3) == ((0, 4), (4, 8), (8, 10))
    assert ranges(5, 3, 9) == ((0, 3), (3, 5))
    assert ranges(4, 4, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))


def _plan(shape, **kwargs):
    return lambda: BlockingConfig(**kwargs).plan(*shape)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: BlockingConfig(mode="zz"),
            f"unknown blocking mode 'zz'; expected one of {MODES}",
        ),
        (lambda: BlockingConfig(mode="hq", head_block_size=1), "mode 'hq' needs num_q_blocks"),
        (
            lambda: BlockingConfig(
                mode="bhqkv", head_block_size=1, num_q_blocks=1, num_kv_blocks=1
            ),
            "mode 'bhqkv' needs num_batch_blocks",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=1, prefill_block_chunks=2),
            "prefill_block_chunks=2 is not used by mode 'kv'",
        ),
        (
            lambda: BlockingConfig(mode="q", num_q_blocks=1, prefill_n_rep_chunk=1),
            "prefill_n_rep_chunk=1 is not used by mode 'q'",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=True),
            "num_kv_blocks must be an int >= 1, got True",
        ),
        (
            lambda: BlockingConfig(mode="q", num_q_blocks=2.0),
            "num_q_blocks must be an int >= 1, got 2.0",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=1, ctx_len=0),
            "ctx_len must be an int >= 1, got 0",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=1, headpar_split="2"),
            "headpar_split must be an int >= 0, got '2'",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=1, headpar_split=0, num_cores=0),
            "num_cores must be an int >= 1, got 0",
        ),
        (
            lambda: BlockingConfig(mode="hq", head_block_size=1, num_q_blocks=1, headpar_split=1),
            "headpar_split needs a mode that blocks the cache, not 'hq'",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=1, headpar_split=2, num_cores=4),
            "num_cores only sets headpar_split=0; give headpar_split=0 with it",
        ),
        (
            lambda: BlockingConfig(mode="kv", num_kv_blocks=1, num_cores=4),
            "num_cores only sets headpar_split=0; give headpar_split=0 with it",
        ),
        (
            lambda: BlockingConfig.from_qaic_config(
                {"prefill_blocking_mode": "kv_headpar"}, prefill=True
            ),
            "unknown prefill_blocking_mode 'kv_headpar' in qaic_config",
        ),
        (
            _plan((1, 6, 4, 4, 8), mode="kv", num_kv_blocks=2),
            "query heads 6 must be a multiple of kv heads 4",
        ),
        (
            _plan((1, 2, 1, 4, 8), mode="kv", num_kv_blocks=2, ctx_len=7),
            r"ctx_len=7 is shorter than the cache (8 slots)",
        ),
        (
            _plan((1, 2, 1, 4, 8), mode="kv", num_kv_blocks=9, ctx_len=8),
            "num_kv_blocks=9 is more blocks than the 8 ctx_len slots",
        ),
        (
            _plan((1, 2, 1, 4, 8), mode="hq", head_block_size=1, num_q_blocks=5),
            "num_q_blocks=5 is more blocks than the 4 queries",
        ),
        (
            _plan((1, 2, 1, 4, 8), mode="prefill_q", prefill_block_chunks=5),
            "prefill_block_chunks=5 is more blocks than the 4 queries",
        ),
        (
            _plan(
                (2, 2, 1, 4, 8),
                mode="bhqkv",
                num_batch_blocks=3,
                head_block_size=1,
                num_q_blocks=1,
                num_kv_blocks=1,
            ),
            "num_batch_blocks=3 is more blocks than the 2 batch rows",
        ),
        (
            _plan((1, 8, 2, 4, 8), mode="prefill_kv", num_kv_blocks=1, prefill_n_rep_chunk=3),
            "prefill_n_rep_chunk=3 must divide the GQA group size 4",
        ),
        (
            _plan((1, 8, 2, 4, 8), mode="hkv", head_block_size=9, num_kv_blocks=1),
            "head_block_size=9 is more than the 8 query heads",
        ),
        (
            _plan((1, 8, 2, 4, 8), mode="h", head_block_size=6),
            "head_block_size=6 must be a multiple or a divisor of the GQA group size 4 "
            "(query heads per kv head)",
        ),
    ],
)
def test_error_messages_exact(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert str(err.value) == message


def test_boundaries_that_are_accepted():
    """The limits themselves are valid: one block per token, head blocks of all query heads,
    ctx_len equal to the cache, headpar_split 0, a folded batch blocking 8 folded heads."""
    cfg = BlockingConfig(mode="hqkv", head_block_size=8, num_q_blocks=4, num_kv_blocks=8)
    plan = cfg.plan(1, 8, 2, 4, 8)
    assert len(plan.q) == 4 and len(plan.kv) == 8 and plan.heads == ((0, 2, ((0, 4),)),)
    cfg = BlockingConfig(
        mode="bhqkv",
        num_batch_blocks=2,
        head_block_size=2,
        num_q_blocks=1,
        num_kv_blocks=1,
        ctx_len=8,
    )
    assert cfg.plan(2, 2, 1, 4, 8).batch == ((0, 1), (1, 2))
    folded = BlockingConfig(mode="h", head_block_size=8, batch_fold=True)
    assert folded.plan(2, 4, 2, 4, 8).heads == ((0, 4, ((0, 2),)),)
    # A group size that is a multiple of the block, a block that is a multiple of the group.
    assert BlockingConfig(mode="h", head_block_size=2).plan(1, 8, 2, 1, 1).heads == (
        (0, 1, ((0, 2), (2, 4))),
        (1, 2, ((0, 2), (2, 4))),
    )
    assert BlockingConfig(mode="prefill_kv", num_kv_blocks=1).plan(1, 4, 1, 1, 1).heads == (
        (0, 1, ((0, 4),)),
    )


def test_modes_without_an_axis_get_one_block_on_it():
    """No kv axis → the whole cache in one block; no b axis → one batch block; num_devices
    defaults to 1; a folded batch with head blocks inside a GQA group."""
    plan = BlockingConfig(mode="h", head_block_size=1, batch_fold=True).plan(2, 4, 2, 3, 8)
    assert plan == Plan(
        batch=((0, 1),),
        heads=tuple((j, j + 1, ((0, 1), (1, 2))) for j in range(4)),
        q=((0, 3),),
        kv=((0, 8),),
        split=1,
        parallel=False,
        skip_kv=False,
        batch_fold=True,
    )
    plan = BlockingConfig(mode="q", num_q_blocks=3).plan(2, 2, 1, 3, 8)
    assert (plan.batch, plan.kv, plan.q) == (((0, 2),), ((0, 8),), ((0, 1), (1, 2), (2, 3)))
    headpar = BlockingConfig(mode="kv", num_kv_blocks=2, headpar_split=0)
    assert headpar.plan(1, 2, 1, 1, 8).split == 1


def test_from_qaic_config_drops_what_the_mode_does_not_take():
    """ "none" means no blocking; batch_fold is dropped for a mode that blocks the batch;
    num_cores only travels with headpar_split 0."""
    assert BlockingConfig.from_qaic_config({"blocking_mode": "none"}) is None
    assert BlockingConfig.from_qaic_config({"prefill_blocking_mode": "none"}, prefill=True) is None
    counts = dict(num_batch_blocks=1, head_block_size=1, num_q_blocks=1, num_kv_blocks=1)
    cfg = BlockingConfig.from_qaic_config({"blocking_mode": "bhqkv", "batch_fold": True, **counts})
    assert cfg == BlockingConfig(mode="bhqkv", **counts)
    cfg = BlockingConfig.from_qaic_config(
        {"blocking_mode": "kv", "num_kv_blocks": 2, "num_cores": 8}
    )
    assert cfg == BlockingConfig(mode="kv", num_kv_blocks=2)
    cfg = BlockingConfig.from_qaic_config(
        {"blocking_mode": "kv", "num_kv_blocks": 2, "headpar_split": 2, "num_cores": 8}
    )
    assert cfg == BlockingConfig(mode="kv", num_kv_blocks=2, headpar_split=2)


def test_docs_table_of_modes_is_the_table():
    """docs/attention.md holds `ref.blocking.markdown_table()` verbatim; every
    name any entry point uses resolves to one row."""
    from pathlib import Path

    from ref import blocking

    root = Path(__file__).parents[2]
    assert blocking.markdown_table() in (root / "docs/attention.md").read_text()
    for prefill in (False, True):
        for name in blocking.names(prefill=prefill):
            resolved = blocking.resolve(name, prefill=prefill)
            assert resolved is None or resolved[0] in blocking.MODES, name
    assert blocking.resolve("online", prefill=True) == ("prefill_online", {})
    assert blocking.resolve("kv_headpar") == ("kv", {"headpar_split": 2})
    with pytest.raises(ValueError, match="unknown blocking mode 'online'"):
        blocking.resolve("online")


def test_names_per_phase():
    from ref import blocking

    assert blocking.names() == (
        ("none", "dense") + blocking.MODES + ("kv_headpar", "kv_batch_fold")
    )
    assert blocking.names(prefill=True) == (
        ("none", "dense", "q", "kv", "qkv", "online")
        + tuple(m for m in blocking.MODES if m not in ("q", "kv", "qkv"))
        + ("kv_headpar", "kv_batch_fold")
    )


def test_default_options_and_for_phase_clip_defaults_only():
    """A name alone gets its row's defaults (and its alias's options), clipped to the phase's
    batch, queries and keys; options given explicitly are kept as given (and checked)."""
    from ref import blocking

    one = dict(batch=1, queries=1, kv_len=1)
    assert blocking.default_options("none") is None
    assert blocking.default_options("bhqkv") == (
        "bhqkv",
        {"num_batch_blocks": 2, "head_block_size": 1, "num_q_blocks": 2, "num_kv_blocks": 2},
    )
    assert blocking.default_options("kv_batch_fold") == (
        "kv",
        {"num_kv_blocks": 2, "batch_fold": True},
    )
    assert blocking.default_options("q", prefill=True) == (
        "prefill_q",
        {"prefill_block_chunks": 2},
    )
    assert blocking.default_options("q") == ("q", {"num_q_blocks": 2})
    assert blocking.for_phase("qkv", prefill=True, **one) == BlockingConfig(
        mode="prefill_qkv", prefill_block_chunks=1, num_kv_blocks=1
    )
    assert blocking.for_phase("bhqkv", prefill=False, **one) == BlockingConfig(
        mode="bhqkv", num_batch_blocks=1, head_block_size=1, num_q_blocks=1, num_kv_blocks=1
    )
    assert blocking.for_phase("online", prefill=True, batch=3, queries=5, kv_len=9) == (
        BlockingConfig(mode="prefill_online", prefill_block_chunks=2, num_kv_blocks=2)
    )
    assert blocking.for_phase(
        "kv_headpar", {"num_kv_blocks": 3}, prefill=False, batch=2, queries=4, kv_len=8
    ) == BlockingConfig(mode="kv", num_kv_blocks=3, headpar_split=2)
    assert blocking.for_phase("dense", prefill=True, **one) is None
    assert blocking.for_phase(None, None, prefill=False, **one) is None
    with pytest.raises(ValueError, match="dense attention .'none'. takes no options"):
        blocking.for_phase("none", {"num_kv_blocks": 2}, prefill=False, **one)
    with pytest.raises(ValueError, match="num_q_blocks=1 is not used by mode 'kv'"):
        blocking.for_phase("kv", {"num_q_blocks": 1}, prefill=False, **one)
    with pytest.raises(ValueError, match="unknown blocking mode 'online'"):
        blocking.for_phase("online", prefill=False, **one)
