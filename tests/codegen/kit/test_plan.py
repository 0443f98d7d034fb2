"""`python -m codegen plan`: the schedule's FLOPs, exps, bytes and peak working memory against a
brute-force count over every (batch row, query head, query, key) placed by the plan's ranges;
tile statuses against key-by-key visibility; the PNG and its tile count; one-line errors."""

import json

import numpy as np
import pytest
from PIL import Image

from codegen.__main__ import main
from codegen.kit import moe_schedule, vector_options
from codegen.kit import schedule as kit
from tests.visibility import visible_numpy

SMALL = {"batch": "2", "heads": "4", "kv_heads": "2", "seq": "6", "ctx": "10", "head_dim": "4"}

CASES = [
    ("dense", {"sliding_window": "3"}),
    ("qkv", {}),
    ("kv", {"num_kv_blocks": "3", "headpar_split": "2", "skip_kv": "true", "q_start": "0"}),
    ("kv", {"batch_fold": "true", "skip_kv": "true", "sliding_window": "2"}),
    ("h", {"head_block_size": "4"}),
    ("hq", {"head_block_size": "1", "num_q_blocks": "4"}),
    ("hkv", {"ctx_len": "16", "num_kv_blocks": "4", "skip_kv": "true"}),
    ("hqkv", {"skip_kv": "true", "sliding_window": "3", "vision": "3", "q_start": "2"}),
    ("bhqkv", {"num_batch_blocks": "2", "num_kv_blocks": "3", "skip_kv": "true"}),
    ("prefill_q", {"prefill_block_chunks": "3"}),
    ("prefill_qkv", {"headpar_split": "3", "skip_kv": "true", "sliding_window": "4"}),
    ("prefill_online", {"prefill_n_rep_chunk": "1", "skip_kv": "true", "q_start": "1"}),
]


def block_of(bounds, i):
    return next(n for n, (a, c) in enumerate(bounds) if a <= i < c)


def pieces(a, c, split):
    size = -(-(c - a) // split)
    return len(range(a, c, size))


def brute_force(plan, visible, sizes, itemsize):
    """Totals by placing every (b, query head, query, key) in its loop and KV block."""
    b, h, hkv, s, t, d = sizes
    g = h // hkv
    loops = {}
    for bi in range(b):
        for hq in range(h):
            j, r = divmod(hq, g)
            row = bi * hkv + j if plan.batch_fold else j
            bb = 0 if plan.batch_fold else block_of(plan.batch, bi)
            hb = next(n for n, (k0, k1, _) in enumerate(plan.heads) if k0 <= row < k1)
            rb = block_of(plan.heads[hb][2], r)
            for si in range(s):
                loop = loops.setdefault((bb, hb, rb, block_of(plan.q, si)), {"rows": set()})
                loop["rows"].add((bi, hq, si))
                for ti in range(t):
                    tile = loop.setdefault(block_of(plan.kv, ti), {"quads": set(), "seen": False})
                    tile["quads"].add((bi, hq, si, ti))
                    tile["seen"] |= bool(visible[bi, si, ti])
    total = dict(qk=0, exps=0, bytes=0, peak=0, computed=0, empty=0, skipped=0)
    for loop in loops.values():
        rows = len(loop.pop("rows"))
        state = rows * (d + 2)
        kept = [(kb, tl) for kb, tl in sorted(loop.items()) if tl["seen"] or not plan.skip_kv]
        total["skipped"] += len(loop) - len(kept)
        total["computed"] += sum(tl["seen"] for _, tl in kept)
        total["empty"] += sum(not tl["seen"] for _, tl in kept)
        quads = sum(len(tl["quads"]) for _, tl in kept)
        total["qk"] += 2 * d * quads
        kv_triples = sum(len({(q[0], q[1] // g, q[3]) for q in tl["quads"]}) for _, tl in kept)
        total["bytes"] += itemsize * d * (2 * rows + 2 * kv_triples)
        if plan.parallel:
            n = [pieces(*plan.kv[kb], plan.split) for kb, _ in kept]
            total["exps"] += quads + (rows * sum(n) if sum(n) > 1 else 0)
            peaks = [len(tl["quads"]) + state * sum(n[: i + 1]) for i, (_, tl) in enumerate(kept)]
        else:
            total["exps"] += quads + rows * max(len(kept) - 1, 0)
            peaks = [len(tl["quads"]) + state for _, tl in kept]
        total["peak"] = max(total["peak"], 4 * max([state, *peaks]))
    return total


@pytest.mark.parametrize("mode, given", CASES, ids=lambda x: str(x))
def test_costs_equal_a_brute_force_count_over_the_tiles(mode, given):
    mode, options = vector_options.resolve("attention", mode, SMALL | given)
    report = kit.report(mode, options, "float16")
    sizes = vector_options.attention_sizes(options)
    q_pos, kv_pos, q_group, kv_group = vector_options.attention_positions(options)
    visible = visible_numpy(q_pos, kv_pos, q_group, kv_group, options["sliding_window"])
    assert (report["visible"] == visible).all()
    want = brute_force(report["plan"], visible, sizes, 2)
    got = report["total"]
    assert (got.computed, got.empty, got.skipped) == (
        want["computed"],
        want["empty"],
        want["skipped"],
    )
    assert got.qk_flops == got.pv_flops == want["qk"]
    assert (got.exps, got.bytes, got.peak) == (want["exps"], want["bytes"], want["peak"])
    b, h, hkv, s, t, d = sizes
    dense = report["dense"]
    assert dense.qk_flops == 2 * b * h * s * t * d and dense.exps == b * h * s * t
    assert dense.bytes == 2 * (2 * b * h * s * d + 2 * b * hkv * t * d)
    assert dense.peak == 4 * (b * h * s * t + b * h * s * (d + 2))
    assert len(report["per"]) == len(kit.loops(report["tiles"]))
    assert "total" in report["table"] and "blocked/dense" in report["table"]


def test_skip_kv_skips_exactly_the_blocks_nobody_sees():
    mode, options = vector_options.resolve(
        "attention", "qkv", SMALL | {"skip_kv": "true", "sliding_window": "2", "num_kv_blocks": "5"}
    )
    report = kit.report(mode, options)
    visible = report["visible"]
    for tile in report["tiles"]:
        (r0, r1), (q0, q1), (t0, t1) = tile.rows, tile.q, tile.kv
        assert (tile.status == "skipped") == (not visible[r0:r1, q0:q1, t0:t1].any())
    assert {t.status for t in report["tiles"]} == {"computed", "skipped"}
    assert [t.order for t in report["tiles"]] == list(range(1, len(report["tiles"]) + 1))


def test_png_is_drawn_with_every_tile_of_the_plan(tmp_path, capsys):
    png = tmp_path / "hqkv.png"
    args = ["plan", "--mode", "hqkv", "--opt", "skip_kv=true", "--opt", "sliding_window=3"]
    assert main([*args, "--seq", "4", "--ctx", "8", "--head-dim", "4", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "dense" in out and f"wrote {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    with Image.open(png) as image:
        info = json.loads(image.text["Description"])
        assert image.size[0] > 500 and image.size[1] > 300
    _, options = vector_options.resolve(
        "attention", "hqkv", {"seq": "4", "ctx": "8", "skip_kv": "true"}
    )
    plan = kit.make_plan("hqkv", options)
    want = len(plan.batch) * sum(len(reps) for *_, reps in plan.heads) * len(plan.q) * len(plan.kv)
    assert info["tiles"] == info["tiles_total"] == want == 16


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "qkv", "--opt", "num_q_blocks=99"], "num_q_blocks=99 is more blocks"),
        (["--mode", "hq", "--opt", "head_block_size=3"], "head_block_size=3 must be a multiple"),
        (["--op", "pool"], "invalid choice: 'pool'"),
        (["--op", "moe", "--mode", "nsp", "--opt", "num_nsp=3"], "num_nsp=3 does not divide"),
        (["--mode", "kv", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["--mode", "kv", "--ctx", "x"], "option ctx='x': expected an integer"),
    ],
)
def test_bad_plan_options_are_one_line_errors(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


MOE = {"tokens": "8", "hidden": "4", "experts": "4", "intermediate": "2", "top_k": "2"}


@pytest.mark.parametrize(
    "mode, given, per_core, total",
    [
        # hand counts (items, rows, FLOPs, weight bytes), float16 weights: an expert's gate_up
        # and down are 3·I·D = 24 values = 48 bytes; a row through both is 2·D·2I + 2·I·D = 48
        # FLOPs
        ("dense", {}, {0: (4, 32, 1536, 192)}, (4, 32, 1536, 192)),
        ("gather", {}, {0: (16, 16, 768, 768)}, (16, 16, 768, 768)),
        # 2 cores x 2 slots x 2 chunks of 4 rows: every chunk runs, each reads its expert
        ("nsp", {"hot": "6"}, {0: (4, 16, 768, 192), 1: (4, 16, 768, 192)}, (8, 32, 1536, 384)),
    ],
    ids=str,
)
def test_moe_costs_equal_a_hand_count(mode, given, per_core, total):
    mode, options = vector_options.resolve("moe", mode, MOE | given)
    report = moe_schedule.report(mode, options, "float16")
    fields = ("items", "rows", "flops", "weight_bytes")
    got = {c: tuple(getattr(cost, f) for f in fields) for c, cost in report["per"].items()}
    assert got == per_core
    assert tuple(getattr(report["total"], f) for f in fields) == total
    assert tuple(getattr(report["dense"], f) for f in fields) == (4, 32, 1536, 192)
    # routed rows: the picks of each core's experts (nsp: core c holds experts c and c + 2)
    count = np.bincount(report["index"].ravel(), minlength=4)
    cores = {0: [0, 1, 2, 3]} if mode != "nsp" else {0: [0, 2], 1: [1, 3]}
    assert {c: cost.routed for c, cost in report["per"].items()} == {
        c: int(count[e].sum()) for c, e in cores.items()
    }
    assert report["total"].routed == 16 and "mode/dense" in report["table"]


@pytest.mark.parametrize("given", [{"hot": "7"}, {"experts": "8", "num_nsp": "4"}], ids=str)
def test_nsp_items_hold_every_pick_once_in_their_experts_core_and_slot(given):
    mode, options = vector_options.resolve("moe", "nsp", MOE | given)
    report = moe_schedule.report(mode, options)
    index, how = report["index"], report["mode"]
    want = np.bincount(index.ravel(), minlength=options["experts"])
    routed = np.zeros_like(want)
    for item in report["items"]:
        assert item.expert == item.slot * how.num_nsp + item.core
        routed[item.expert] += item.routed
    assert (routed == want).all() and routed.sum() == index.size
    # nsp: every chunk of every expert computed, dense's FLOPs
    assert report["total"].flops == report["dense"].flops
    chunks = options["tokens"] // how.packed_chunk
    assert report["total"].weight_bytes == chunks * report["dense"].weight_bytes


def test_moe_png_draws_every_item(tmp_path, capsys):
    png = tmp_path / "nsp.png"
    args = ["plan", "--op", "moe", "--mode", "nsp", "--opt", "hot=5", "--png", str(png)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mode/dense: FLOPs 1.000, weight bytes 2.000" in out and f"wrote {png}" in out
    with Image.open(png) as image:
        info = json.loads(image.text["Description"])
    assert info == {"tiles": 8, "tiles_total": 8, "panels": 2, "panels_total": 2}
