"""Bad input at every public entry point: each case computes what its valid twin computes or
raises the project's ValueError naming the bad value — never NaN, a silent clamp, or a
library's traceback. The table of cases and messages is docs/errors.md."""

import json

import jax.numpy as jnp
import numpy as np
import onnx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from codegen.__main__ import main
from codegen.export.defaults import DEFAULT_CONFIG, default_checkpoint
from ref.attention import blocked, reference
from ref.gemma4 import Gemma4, VisionTower
from ref.gemma4.kv_cache import init_cache
from ref.gemma4.step import step
from tests.util import examples, folder_copy, small_export

VOCAB = DEFAULT_CONFIG["text_config"]["vocab_size"]
BAD_FLOATS = st.sampled_from([np.nan, np.inf, -np.inf])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return default_checkpoint(tmp_path_factory.mktemp("default") / "model")


@pytest.fixture(scope="module")
def model(checkpoint):
    return Gemma4.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def tower(checkpoint):
    return VisionTower.from_pretrained(checkpoint)


def prompt():
    """Text, an image of 6×6 patches (4 soft tokens: begin 5, image 4 ×4, end 6), text."""
    return np.array([[2, 10, 11, 5, 4, 4, 4, 4, 6, 12]])


def patches(rng):
    return [rng.random((36, 48), dtype=np.float32)]


@settings(max_examples=examples(8))
@given(bad=BAD_FLOATS, index=st.tuples(st.integers(0, 35), st.integers(0, 47)))
def test_tower_refuses_non_finite_patches(tower, bad, index):
    x = patches(np.random.default_rng(0))
    x[0][index] = bad
    with pytest.raises(ValueError, match=rf"patches\[0\]\[{index[0]}, {index[1]}\] = .*finite"):
        tower.encode(x, [(6, 6)])


@settings(max_examples=examples(8))
@given(bad=st.sampled_from([-1, -7, VOCAB, VOCAB + 1, 2**31 - 1]), at=st.integers(0, 9))
def test_generate_refuses_token_ids_outside_the_vocabulary(model, bad, at):
    ids = prompt()
    ids[0, at] = bad
    with pytest.raises(ValueError, match=rf"input_ids\[0, {at}\] = {bad}: expected a token id"):
        model.generate(ids, patches(np.random.default_rng(0)), [(6, 6)], max_new_tokens=2)


def test_generate_ignores_what_lies_past_a_row_s_length(model):
    """A right-padded row's tail is not read: garbage there gives the valid twin's tokens."""
    rng = np.random.default_rng(1)
    ids = np.concatenate([prompt(), prompt()])
    twin = model.generate(ids, patches(rng) * 2, [(6, 6)] * 2, max_new_tokens=3, lengths=[10, 10])
    ids = np.concatenate([ids, np.full((2, 3), 10**6)], axis=1)
    rng = np.random.default_rng(1)
    got = model.generate(ids, patches(rng) * 2, [(6, 6)] * 2, max_new_tokens=3, lengths=[10, 10])
    np.testing.assert_array_equal(got, twin)


def test_generate_refuses_non_finite_patches_and_embeds(model):
    x = patches(np.random.default_rng(0))
    x[0][3, 5] = np.nan
    with pytest.raises(ValueError, match=r"patches\[0\]\[3, 5\] = nan"):
        model.generate(prompt(), x, [(6, 6)], max_new_tokens=2)
    embeds = np.zeros((4, DEFAULT_CONFIG["text_config"]["hidden_size"]), np.float32)
    embeds[2, 1] = np.inf
    with pytest.raises(ValueError, match=r"images\[0\] \(row 0\)\[2, 1\] = inf"):
        model.generate_embedded(prompt(), [embeds], max_new_tokens=2)


def _step_inputs(model):
    cfg = model.config
    cache = init_cache(cfg, 1, 16)
    ids = jnp.asarray(prompt()[:, :8], jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    vision = jnp.zeros((1, 8, cfg.hidden_size), jnp.float32)
    return cache, ids, pos, vision, jnp.zeros((1, 1), jnp.int32)


def _step(model, cache, ids, pos, vision, idx):
    return step(model.params, model.lm_head, cache, ids, pos, vision, idx, config=model.config)


@pytest.mark.parametrize(
    "case, words",
    [
        ("id past vocab", r"input_ids\[0, 2\] = 256: expected a token id in \[0, 256\)"),
        (
            "position past ctx",
            r"position_ids\[0, 7\] = 16: expected −1 \(padding\) or ≥ 0 and < 16",
        ),
        ("position below -1", r"position_ids\[0, 0\] = -2"),
        ("nan soft token", r"vision_embeds\[0, 3, 1\] = nan"),
        ("image_idx past V", r"image_idx\[0\] = 9: expected the next unread soft token"),
        ("negative image_idx", r"image_idx\[0\] = -1"),
    ],
)
def test_step_refuses_bad_values(model, case, words):
    cache, ids, pos, vision, idx = _step_inputs(model)
    if case == "id past vocab":
        ids = ids.at[0, 2].set(VOCAB)
    elif case == "position past ctx":
        pos = pos + 9
    elif case == "position below -1":
        pos = pos.at[0, 0].set(-2)
    elif case == "nan soft token":
        vision = vision.at[0, 3, 1].set(jnp.nan)
    elif case == "image_idx past V":
        idx = idx + 9
    else:
        idx = idx - 1
    with pytest.raises(ValueError, match=words):
        _step(model, cache, ids, pos, vision, idx)


def test_step_ignores_ids_of_padding_columns(model):
    """A padding column (position −1) writes nothing and no valid column sees it: any id
    there leaves the valid columns' logits and the cache as they are."""
    cache, ids, pos, vision, idx = _step_inputs(model)
    pos = pos.at[0, 6:].set(-1)
    twin = _step(model, cache, ids, pos, vision, idx)
    got = _step(model, cache, ids.at[0, 6:].set(10**6), pos, vision, idx)
    np.testing.assert_array_equal(np.asarray(got["logits"])[:, :6], twin["logits"][:, :6])
    for kind in ("k", "v"):
        for layer, x in twin["cache"][kind].items():
            np.testing.assert_array_equal(np.asarray(got["cache"][kind][layer]), x)


@settings(max_examples=examples(6))
@given(bad=BAD_FLOATS, which=st.sampled_from(["q", "k", "v"]), mode=st.sampled_from([None, "kv"]))
def test_attention_refuses_non_finite_inputs(bad, which, mode):
    rng = np.random.default_rng(0)
    x = {n: rng.standard_normal((1, 2, 4, 8)) for n in ("q", "k", "v")}
    x[which][0, 1, 2, 3] = bad
    pos = np.arange(4)[None]
    fn = reference if mode is None else (lambda *a: blocked(*a, mode="kv", num_kv_blocks=2))
    with pytest.raises(ValueError, match=rf"{which}\[0, 1, 2, 3\] = .*: expected finite"):
        fn(x["q"], x["k"], x["v"], pos, pos)


def test_attention_refuses_positions_below_padding():
    x = np.zeros((1, 2, 4, 8))
    pos = np.arange(4)[None]
    with pytest.raises(ValueError, match=r"kv_pos\[0, 1\] = -5"):
        reference(x, x, x, pos, np.array([[0, -5, 2, 3]]))


@pytest.fixture(scope="module")
def exported(checkpoint, tmp_path_factory):
    return small_export(checkpoint, tmp_path_factory)


def _tampered(exported, tmp_path, how):
    """A copy of the export (shards copied, not linked) changed one way."""
    folder = folder_copy(exported, tmp_path)
    shard = folder / "model.safetensors"
    if how == "byte flipped":
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:-4])
    elif how == "missing":
        shard.unlink()
    elif how == "offset moved":
        model = onnx.load(folder / "language.onnx", load_external_data=False)
        t = next(t for t in model.graph.initializer if t.external_data)
        entry = next(e for e in t.external_data if e.key == "offset")
        entry.value = str(int(entry.value) + 2)
        (folder / "language.onnx").write_bytes(model.SerializeToString())
    return folder


@pytest.mark.parametrize(
    "how, words",
    [
        ("byte flipped", "blake3 differs"),
        ("truncated", "bytes, manifest.json records"),
        ("missing", "missing (manifest.json lists it)"),
        ("offset moved", "language.onnx: weight"),
    ],
)
@pytest.mark.parametrize("command", ["run", "verify"])
def test_changed_export_folder_is_refused(exported, tmp_path, capsys, how, words, command):
    folder = _tampered(exported, tmp_path, how)
    args = [command, str(folder)] + (["--prompt-ids", "2,10,11"] if command == "run" else [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_skip_shard_check_says_so(exported, tmp_path, capsys):
    folder = _tampered(exported, tmp_path, "byte flipped")
    assert main(["run", str(folder), "--prompt-ids", "2,10,11", "--skip-shard-check"]) == 0
    assert "--skip-shard-check" in capsys.readouterr().err


def test_run_refuses_non_finite_patch_files(exported, tmp_path, capsys):
    x = np.random.default_rng(0).random((36, 48), dtype=np.float32)
    x[1, 2] = np.nan
    np.save(tmp_path / "p.npy", x)
    args = ["run", str(exported), "--prompt-ids", ",".join(map(str, prompt()[0]))]
    assert main([*args, "--patches", str(tmp_path / "p.npy"), "--grid", "6x6"]) == 2
    assert "patches[0][1, 2] = nan" in capsys.readouterr().err


def test_manifest_that_is_not_json_is_refused(exported, tmp_path, capsys):
    folder = folder_copy(exported, tmp_path)
    (folder / "manifest.json").write_text(json.dumps(["not", "a", "manifest"])[:-3])
    assert main(["verify", str(folder)]) == 2
    assert "manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "verify"])
@pytest.mark.parametrize("found", ["gemma4-qaic-export/0", None])
def test_manifest_of_another_format_is_refused(exported, tmp_path, capsys, command, found):
    """A folder whose manifest.json is not in the format this version writes (an older or a
    newer export, or none recorded) is refused by name before anything else is read."""
    folder = folder_copy(exported, tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["format"] = found
    (folder / "manifest.json").write_text(json.dumps(manifest))
    args = [command, str(folder)] + (["--prompt-ids", "2,10,11"] if command == "run" else [])
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"format {found!r}: expected 'gemma4-qaic-export/1'" in err[0], err


@settings(max_examples=examples(6), deadline=None)
@given(bad=BAD_FLOATS, jax_array=st.booleans(), at=st.integers(0, 2**23 + 39))
@example(bad=np.nan, jax_array=False, at=2**23 + 39)  # the last value, past the last chunk
@example(bad=-np.inf, jax_array=True, at=2**23 + 39)
def test_a_bad_value_in_a_large_array_is_named(bad, jax_array, at):
    """`ref.validate.finite` checks a large array without a copy of it (a jax array in one
    fused reduction, a numpy array a chunk at a time) and still names its one bad value,
    wherever it is (here past the first chunks)."""
    from ref import validate

    a = np.zeros((4, 2**21 + 10), np.float32)
    a.reshape(-1)[at] = bad
    x = jnp.asarray(a) if jax_array else a
    i = np.unravel_index(at, a.shape)
    with pytest.raises(ValueError, match=rf"^k\[{i[0]}, {i[1]}\] = .*: expected finite values"):
        validate.finite("k", x)
    validate.finite("k", jnp.zeros_like(x) if jax_array else np.zeros_like(a))
