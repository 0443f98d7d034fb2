"""`python -m codegen plan`: the schedule's FLOPs, exps, bytes and peak working memory against a
brute-force count over every (batch row, query head, query, key) placed by the plan's ranges;
tile statuses against key-by-key visibility; the PNG and its tile count; one-line errors."""

import json

import pytest
from PIL import Image

from codegen import plan as kit
from codegen import vector_options
from codegen.__main__ import main
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
        (["--mode", "kv", "--dtype", "int8"], "invalid choice: 'int8'"),
        (["--mode", "kv", "--ctx", "x"], "option ctx='x': expected an integer"),
    ],
)
def test_bad_plan_options_are_one_line_errors(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
