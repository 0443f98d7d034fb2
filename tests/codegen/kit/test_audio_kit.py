"""The audio tower's chunked attention in the kernel kit (`vectors --op audio_attention`, `plan
--op audio_attention`): the golden output against the dense reference (`ref.gemma4.
audio_reference`, sharing no code with the chunked path) run here on the stored inputs in
float64, each chunk's key ranges against visibility decided pair by pair here, the picture, and
one-line errors.

Tolerances: out_f64 against the dense reference ≤ 1e-12 relative (the same float64 sums in
another order); out_f32 against it ≤ 2e-6 relative, as the other ops' vectors.
"""

import json
import shlex

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from codegen.__main__ import main
from codegen.kit import audio_schedule, vector_options, vectors
from ref.gemma4.audio_reference import reference
from tests.util import examples, jitted, rel_err
from weights import read_header


@st.composite
def audio_options(draw):
    """--opt values of a packing: 1–3 clips (some empty), maybe a frame budget
    with room for another clip, a chunking (C, context_left = P + 1, F), tiny heads, a cap."""
    frames = draw(st.lists(st.integers(0, 90), min_size=1, max_size=3))
    if not sum(frames):
        frames[0] = 1  # at least one soft token
    chunk, left, right = draw(
        st.one_of(
            st.just((12, 13, 0)), st.tuples(st.integers(1, 6), st.integers(2, 8), st.integers(0, 2))
        )
    )
    given = {
        "clips": ",".join(map(str, frames)),
        "chunk": str(chunk),
        "context_left": str(left),
        "context_right": str(right),
        "heads": str(draw(st.integers(1, 2))),
        "head_dim": str(draw(st.sampled_from([2, 4]))),
        "cap": draw(st.sampled_from(["1.5", "4", "50"])),
    }
    extra = draw(st.none() | st.integers(0, 30))
    if extra is not None:
        given |= {"frame_budget": str(sum(frames) + extra), "max_clips": str(len(frames) + 1)}
    return given


def sees(t, s, segment_ids, past, future):
    """Whether query t sees key s, pair by pair as the dense reference defines it: both in the
    same clip (not filler), the key the query itself or one of its P − 1 past keys, or one of
    its F − 1 later keys (distance below F)."""
    if segment_ids[t] < 0 or segment_ids[t] != segment_ids[s]:
        return False
    d = t - s
    return 0 <= d < past or 0 < -d < future


def pairs(segment_ids, past, future):
    """[M, M] bool, query t sees key s."""
    m = len(segment_ids)
    return np.array([[sees(t, s, segment_ids, past, future) for s in range(m)] for t in range(m)])


@settings(max_examples=examples(3))
@given(given=audio_options(), seed=st.integers(0, 99))
def test_golden_output_equals_the_dense_reference_on_the_stored_inputs(given, seed):
    t, meta = vectors.generate("audio_attention", given=given, seed=seed)
    o = meta["options"]
    q, k, v, rel_k = (t[n].astype(np.float64) for n in ("q", "k", "v", "rel_k"))
    past, future = o["context_left"] - 1, o["context_right"]
    want = jitted(
        reference,
        q,
        k,
        v,
        rel_k,
        t["segment_ids"],
        past=past,
        future=future,
        cap=meta["scalars"]["cap"],
        invalid=-1e9,
    )
    real = t["segment_ids"] >= 0
    assert rel_err(t["out_f64"][real], np.asarray(want)[real]) <= 1e-12
    assert rel_err(t["out_f32"][real], np.asarray(want)[real]) <= 2e-6
    cu = t["cu_tokens"]
    assert (np.diff(cu) == meta["token_counts"]).all() and real.sum() == cu[-1]
    assert rel_k.shape[0] == (o["chunk"] + past + future) // 2 + 1
    tol = meta["tolerance"]["float32"]
    assert tol["ref_error"] == float(np.abs(t["out_f32"] - t["out_f64"]).max())


@settings(max_examples=examples(25))
@given(given=audio_options())
def test_each_chunk_reads_and_sees_what_the_dense_mask_allows(given):
    """Chunks partition each clip's tokens from its first, C at a time; a chunk's window is its
    C + P + F slots from P before its first query, it reads the window's keys inside the clip
    and sees exactly the keys the dense mask lets its queries see."""
    _, options = vector_options.resolve("audio_attention", None, given)
    report = audio_schedule.report(options)
    seg = report["packing"].segment_ids
    cu = report["packing"].cu_tokens
    c, past, future = options["chunk"], options["context_left"] - 1, options["context_right"]
    allowed = pairs(seg, past, future)
    assert (report["visible"] == allowed).all()
    starts = [s for i in range(len(cu) - 1) for s in range(cu[i], cu[i + 1], c)]
    real = [ch for ch in report["chunks"] if ch.clip is not None]
    assert [ch.queries[0] for ch in real] == starts
    for ch in real:
        (q0, q1), clip = ch.queries, (cu[ch.clip], cu[ch.clip + 1])
        assert q1 == min(q0 + c, clip[1]) and (seg[q0:q1] == ch.clip).all()
        assert ch.window == (q0 - past, q0 + c + future)
        assert ch.keys == (max(ch.window[0], clip[0]), min(ch.window[1], clip[1]))
        seen = np.flatnonzero(allowed[q0:q1].any(0))
        assert ch.seen == (seen.min(), seen.max() + 1)
        assert ch.visible == allowed[q0:q1].sum()
    filler = len(report["chunks"]) - len(real)
    assert report["total"].empty == filler and report["total"].computed == len(real)


# ref in float16 casts the -1e9 fill to -inf (numpy warns), as a float16 kernel would: its exp
# is still 0, and every real query sees itself, so no row is all -inf
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_cli_writes_the_vectors_and_a_command_naming_every_option(tmp_path):
    out = tmp_path / "audio"
    args = ["vectors", "--op", "audio_attention", "--opt", "frame_budget=280"]
    assert main([*args, "--opt", "max_clips=4", "--out", str(out), "--fp16"]) == 0
    meta = json.loads((out / "vectors.json").read_text())
    words = shlex.split(meta["command"])
    given = dict(b.split("=", 1) for a, b in zip(words, words[1:], strict=False) if a == "--opt")
    assert vector_options.resolve("audio_attention", None, given)[1] == meta["options"]
    assert given["clips"] == "120,64,80" and words[-3:] == ["--seed", "0", "--fp16"]
    floats = {"q", "k", "v", "rel_k"}
    ints = {"chunk_queries", "chunk_keys", "token_slots", "segment_ids", "cu_tokens"}
    outputs = {"out_f64", "out_f32", "out_f16"}
    names = floats | {f"{n}_f16" for n in floats} | ints | outputs
    assert set(read_header(out / "vectors.safetensors")) == names
    f16 = meta["tolerance"]["float16"]
    assert 0 < f16["ref_error"] < f16["bound"] < 0.1


def test_the_picture_draws_every_chunk_with_a_query(tmp_path, capsys):
    png = tmp_path / "audio.png"
    plan = ["plan", "--op", "audio_attention", "--opt", "frame_budget=280"]
    assert main([*plan, "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "chunked/dense" in printed and f"wrote {png} (7 of 8 tiles drawn)" in printed
    with Image.open(png) as image:
        assert json.loads(image.text["Description"])["tiles"] == 7


@pytest.mark.parametrize(
    "args, message",
    [
        (["--opt", "clips=120,-4"], "option clips='120,-4': expected comma-separated integers"),
        (["--opt", "clips=0,0"], "clips=0,0 give no soft token"),
        (["--opt", "frame_budget=100"], "frame_budget=100 is smaller than the 264 valid frames"),
        (["--opt", "max_clips=2"], "max_clips=2 needs a frame_budget"),
        (["--opt", "context_left=1"], "attention_context_left=1"),
        (["--opt", "chunk=0"], "attention_chunk_size=0"),
        (["--opt", "head_dim=0"], "heads=2, head_dim=0: expected sizes >= 1"),
        (["--opt", "vision=2"], "unknown option 'vision' for --op audio_attention"),
        (["--mode", "kv"], "--mode 'kv' is only for --op attention or --op moe"),
    ],
)
def test_bad_audio_options_are_one_line_errors(tmp_path, capsys, args, message):
    assert main(["vectors", "--op", "audio_attention", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists()
