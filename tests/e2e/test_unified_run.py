"""Gemma 4 12B Unified through the exported graphs: `python -m codegen export` on a tiny
gemma4_unified checkpoint writes the embedder graphs in place of the towers (verified in
onnxruntime as it exports), and `python -m codegen run --image F.png --audio F.wav --prompt
TEXT` gives the tokens transformers' `generate` gives on what Gemma4UnifiedProcessor makes of
the same pixels, samples and text; the towers' options are refused in one line."""

import numpy as np
import pytest
from PIL import Image

from codegen.__main__ import main
from codegen.export.command import ExportOptions, export
from codegen.export.options import ExportError
from tests.hf_processor import word_backend, word_tokenizer
from tests.hf_unified import HF_INPUTS, hf_greedy, hf_unified, unified_processor
from tests.util import write_wav

NEW_TOKENS = 6
MARGIN = 1e-4
BUDGET = 70


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformers model, its folder, export folder): vision budget 70, audio budget 50
    frames, prefill chunks of 70 tokens."""
    model = hf_unified(seed=8)
    folder = tmp_path_factory.mktemp("unified-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    out = tmp_path_factory.mktemp("unified-export") / "out"
    opts = ExportOptions(out=out, model=folder, budgets=(BUDGET,), audio_budgets=(50,),
                         seq_len=BUDGET, ctx_len=256, hash_shards=False)  # fmt: skip
    export(opts, log=lambda m: None)
    return model, folder, out


def test_run_gives_transformers_tokens(exported, tmp_path, capsys):
    model, _, out = exported
    rng = np.random.default_rng(3)
    photo = rng.integers(0, 256, (90, 140, 3), np.uint8)
    Image.fromarray(photo).save(tmp_path / "photo.png")
    ints = rng.integers(-12_000, 12_000, (2_500, 1)).astype(np.int16)
    write_wav(tmp_path / "a.wav", ints, 16_000)
    clip = ints[:, 0].astype(np.float32) / 32768
    prompt = "look <|image|> at <|audio|> then"
    inputs = unified_processor(word_tokenizer(), BUDGET)(
        text=[prompt], images=[[photo]], audio=[clip], return_tensors="pt"
    )
    want, gap = hf_greedy(model, {k: inputs[k] for k in HF_INPUTS if k in inputs}, NEW_TOKENS)
    assert gap > MARGIN, gap
    args = [
        "run",
        str(out),
        "--prompt",
        prompt,
        "--no-chat",
        "--image",
        str(tmp_path / "photo.png"),
    ]
    args += ["--audio", str(tmp_path / "a.wav"), "--max-soft-tokens", str(BUDGET)]
    assert main([*args, "--max-new-tokens", str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)


def test_tower_options_are_refused(exported, tmp_path):
    _, folder, _ = exported
    for bad, match in (({"vision_tiles": (2, 1)}, "--vision-tiles"),
                       ({"audio_clips": 2}, "--audio-clips")):  # fmt: skip
        opts = ExportOptions(out=tmp_path / "x", model=folder, budgets=(BUDGET,), seq_len=BUDGET,
                             ctx_len=256, hash_shards=False, **bad)  # fmt: skip
        with pytest.raises(ExportError, match=f"{match}.*gemma4_unified has no"):
            export(opts, log=lambda m: None)
