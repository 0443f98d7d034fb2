"""A photo and a text prompt in, tokens out: a PNG written here goes through `python -m codegen
run OUT --image F.png --prompt TEXT` (Gemma 4's image processor and prompt expansion in
`ref.gemma4.images`, the checkpoint's tokenizer.json, the exported vision, prefill and decode
graphs in onnxruntime) and gives the tokens transformers' `generate` gives on what its own
Gemma4Processor makes of the same file and text; and so does `Gemma4.generate_from` in `ref`
alone on the pixels and the text."""

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from codegen.__main__ import main
from codegen.export.command import ExportOptions, export
from codegen.run.stream import row_text
from ref.gemma4 import Gemma4
from tests.hf_processor import WORDS, greedy_with_gap, hf_processor, word_backend, word_tokenizer
from tests.text_oracle import hf_model, text_config
from tests.util import examples

NEW_TOKENS = 10
MARGIN = 1e-4
BUDGET, PATCH = 70, 2  # an image of ≤ 70 soft tokens: ≤ 630 patches of 2×2 pixels


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformers model, export folder): a randomized tiny VLM whose position table holds
    any grid a budget-70 image makes, saved with a tokenizer.json, exported whole."""
    text = text_config(moe=False, layer_types=["sliding_attention", "full_attention"], ple=8)
    model = hf_model(text, seed=21, position_embedding_size=256)
    folder = tmp_path_factory.mktemp("photo-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    out = tmp_path_factory.mktemp("photo-export") / "out"
    export(
        ExportOptions(
            out=out,
            model=folder,
            budgets=(BUDGET,),
            seq_len=80,
            ctx_len=128,
            hash_shards=False,
        ),
        log=lambda msg: None,
    )
    return model, out


_REFS = {}


def reference_model(folder):
    if folder not in _REFS:
        _REFS[folder] = Gemma4.from_pretrained(folder)
    return _REFS[folder]


def hf_tokens(model, text, image):
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    return greedy_with_gap(model, inputs, NEW_TOKENS)


@settings(max_examples=examples(3), suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=st.tuples(st.integers(8, 120), st.integers(8, 120)),
    mode=st.sampled_from(["RGB", "RGBA", "L"]),
    words=st.lists(st.sampled_from(WORDS[:9]), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
@example(size=(8, 23), mode="RGB", words=["look", "look", "look"], seed=0)  # ids past the words
def test_png_and_text_prompt_give_transformers_tokens(
    exported, tmp_path_factory, capsys, size, mode, words, seed
):
    model, out = exported
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (*size, channels), dtype=np.uint8)
    path = tmp_path_factory.mktemp("png") / "photo.png"
    Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode).save(path)
    # one word after the image: the tiny model's 6-token sliding window still sees the image's
    # last tokens, so the tokens depend on its pixels (with more words they barely move)
    text = " ".join([*words[:-1], "<|image|>", words[-1]])
    with Image.open(path) as img:
        want, gap = hf_tokens(model, text, img.copy())
    assume(gap > MARGIN)
    args = ["run", str(out), "--image", str(path), "--prompt", text]
    assert main([*args, "--max-new-tokens", str(NEW_TOKENS), "--greedy"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == ",".join(str(int(t)) for t in want)
    # the decoded text, then the ids; ids past the word vocabulary decode to nothing: a note
    decoded = word_backend().decode([int(t) for t in want], skip_special_tokens=False)
    note = f"(no text: the {NEW_TOKENS} ids decode to '')"
    assert len(lines) == 2 and lines[0] == (decoded or note)
    # the same in `ref` alone: Gemma4.generate_from on the pixels and the text
    tokenize = lambda s: word_backend().encode(s).ids  # noqa: E731
    with Image.open(path) as img:
        pixels = np.asarray(img)
    got = reference_model(out).generate_from(
        text, [pixels], max_soft_tokens=BUDGET, tokenize=tokenize, max_new_tokens=NEW_TOKENS
    )
    np.testing.assert_array_equal(got, want)


def test_run_prints_a_visible_line_for_every_row():
    """Ids past tokenizer.json's words decode to nothing: `run` says so instead of a blank."""
    backend = word_backend()
    words = [backend.token_to_id(w) for w in ("look", "at", "this")]
    assert row_text(backend, words) == "look at this"
    assert row_text(backend, [88, 90]) == "(no text: the 2 ids decode to '')"
