"""The chat template (`codegen.run.chat`): a prompt with images and videos rendered as one user turn
plus the model's, against transformers' `Gemma4Processor.apply_chat_template
(add_generation_prompt=True)` with the same template and tokenizer: the same text, and the same
ids once expanded and tokenized; and `run --chat` through an export gives transformers' tokens
for the templated prompt."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from codegen.__main__ import main
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import CHAT_TEMPLATE
from codegen.run import chat
from codegen.run.runtime import Runner
from ref.gemma4.multimodal import prompt_inputs
from ref.gemma4.prompts import PromptTokens
from tests.hf_processor import WORDS, greedy_with_gap, hf_processor, word_backend, word_tokenizer
from tests.text_oracle import hf_generate, hf_model, text_config
from tests.util import examples

BUDGET, PATCH = 70, 2
TOKENS = PromptTokens(image_token_id=4, boi_token_id=5, eoi_token_id=6, video_token_id=7)
SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}


def _content(pieces, images):
    """transformers' message content for our pieces ("<|image|>", "<|video|>" or text)."""
    it = iter(images)
    out = []
    for piece in pieces:
        if piece == TOKENS.image_token:
            out.append({"type": "image", "image": next(it)})
        elif piece == TOKENS.video_token:
            out.append({"type": "video"})
        elif piece == TOKENS.audio_token:
            out.append({"type": "audio"})
        else:
            out.append({"type": "text", "text": piece})
    return out


@st.composite
def prompts(draw):
    """Pieces in a drawn order: words, 0–2 images, 0–2 videos, 0–2 audio clips; and whether
    the text names where the items go (else they come first)."""
    words = [" ".join(draw(st.lists(st.sampled_from(WORDS[:9]), min_size=1, max_size=4)))]
    items = [TOKENS.image_token] * draw(st.integers(0, 2))
    items += [TOKENS.video_token] * draw(st.integers(0, 2))
    items += [TOKENS.audio_token] * draw(st.integers(0, 2))
    order = draw(st.permutations(words + items))
    return order, draw(st.booleans())


@settings(max_examples=examples(12), deadline=None)
@given(drawn=prompts())
def test_rendered_text_is_apply_chat_templates(drawn):
    pieces, placed = drawn
    images = pieces.count(TOKENS.image_token)
    videos = pieces.count(TOKENS.video_token)
    audios = pieces.count(TOKENS.audio_token)
    text = " ".join(pieces) if placed else " ".join(p for p in pieces if not p.startswith("<|"))
    message = chat.user_message(text, images, videos, TOKENS, audios)
    ours = chat.render(CHAT_TEMPLATE, [message], SPECIALS)
    if not placed:  # items first, as the message without placeholders lists them
        marks = (TOKENS.image_token, TOKENS.video_token, TOKENS.audio_token)
        pieces = sorted(pieces, key=lambda p: tuple(p != m for m in marks))
    messages = [{"role": "user", "content": _content(pieces, [None] * images)}]
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH, chat_template=CHAT_TEMPLATE)
    want = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours == want
    assert ours.startswith("<bos><|turn>user\n") and ours.endswith("<turn|>\n<|turn>model\n")


@settings(max_examples=examples(4), deadline=None)
@given(drawn=prompts(), seed=st.integers(0, 2**31 - 1))
def test_templated_ids_are_apply_chat_templates(drawn, seed):
    """Text and images: the rendered prompt expanded and tokenized (no special tokens added: it
    starts with bos) equals apply_chat_template(tokenize=True)'s input_ids."""
    pieces = [p for p in drawn[0] if p not in (TOKENS.video_token, TOKENS.audio_token)]
    rng = np.random.default_rng(seed)
    photos = [rng.integers(0, 256, (int(rng.integers(8, 40)), 20, 3), np.uint8) for _ in pieces]
    photos = photos[: pieces.count(TOKENS.image_token)]
    text = " ".join(pieces)
    rendered = chat.render(
        CHAT_TEMPLATE, [chat.user_message(text, len(photos), 0, TOKENS)], SPECIALS
    )
    ids, _, _, _ = prompt_inputs(
        rendered,
        photos,
        (),
        patch_size=PATCH,
        pooling_kernel_size=3,
        tokens=TOKENS,
        tokenize=lambda s: word_backend().encode(s, add_special_tokens=False).ids,
        max_soft_tokens=BUDGET,
    )
    messages = [{"role": "user", "content": _content(pieces, map(Image.fromarray, photos))}]
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH, chat_template=CHAT_TEMPLATE)
    want = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    np.testing.assert_array_equal(ids, np.asarray(want).reshape(-1))


def test_user_message_refuses_a_count_the_prompt_does_not_hold():
    with pytest.raises(chat.ChatError, match="places 1 images, 0 videos, 0 audios but 2, 0, 0"):
        chat.user_message("look <|image|> at", 2, 0, TOKENS)
    with pytest.raises(chat.ChatError, match="places 0 images, 0 videos, 1 audios but 0, 0, 2"):
        chat.user_message("hear <|audio|>", 0, 0, TOKENS, 2)
    with pytest.raises(chat.ChatError, match="the chat template failed: no system turn"):
        chat.render("{{ raise_exception('no system turn') }}", [], {})


def test_template_sources(tmp_path):
    assert chat.read_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": [{"name": "tool_use", "template": "T"}, '
        '{"name": "default", "template": "D"}], "bos_token": {"content": "<bos>"}}'
    )
    assert chat.read_template(tmp_path) == "D"
    assert chat.special_tokens(tmp_path) == {"bos_token": "<bos>"}
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat.read_template(tmp_path) == "J"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(transformers model, export folder with the chat template and tokenizer_config.json)."""
    text = text_config(moe=False, layer_types=["sliding_attention", "full_attention"], ple=8)
    model = hf_model(text, seed=29, position_embedding_size=256)
    folder = tmp_path_factory.mktemp("chat-model")
    model.save_pretrained(folder)
    word_backend().save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "tokenizer_config.json").write_text('{"bos_token": "<bos>", "eos_token": "<eos>"}')
    out = tmp_path_factory.mktemp("chat-export") / "out"
    options = dict(budgets=(BUDGET,), seq_len=96, ctx_len=160, hash_shards=False)
    export(ExportOptions(out=out, model=folder, **options), log=lambda msg: None)
    return model, out


def test_run_renders_the_template_and_gives_transformers_tokens(exported, tmp_path, capsys):
    model, out = exported
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, (30, 24, 3), np.uint8)
    path = tmp_path / "photo.png"
    Image.fromarray(pixels).save(path)
    text = "look at <|image|> this"
    pieces = ["look at", TOKENS.image_token, "this"]
    messages = [{"role": "user", "content": _content(pieces, [Image.open(path)])}]
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH, chat_template=CHAT_TEMPLATE)
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    want, gap = greedy_with_gap(model, inputs, 8)
    assert gap > 1e-4
    assert (
        main(["run", str(out), "--image", str(path), "--prompt", text, "--max-new-tokens", "8"])
        == 0
    )
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
    # --no-chat sends the text as it is: other ids, other tokens (the template is what matters)
    plain = ["run", str(out), "--image", str(path), "--prompt", text, "--no-chat"]
    assert main([*plain, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] != ",".join(str(int(t)) for t in want)


def test_run_stops_at_the_end_of_a_turn_and_samples_reproducibly(exported, capsys):
    """A stop id the model emits mid-generation (`--eos-id`) ends `run` where transformers'
    generate ends; a seeded --sample repeats itself and top-k 1 is greedy."""
    model, out = exported
    ids = [2, 9, 10, 11, 12]
    row = np.array(ids)
    free, _ = hf_generate(model, row, [], [], 12, eos=None)
    stop = int(free[4])
    want, _ = hf_generate(model, row, [], [], 12, eos=stop)
    assert len(want) <= 5
    run = ["run", str(out), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "12"]
    assert main([*run, "--eos-id", str(stop), "--quiet"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
    got = Runner(out, check_shards=False).generate([row], max_new_tokens=12, stop=(stop,))
    np.testing.assert_array_equal(got, want[None])  # ends there: no step after the stop id
    greedy = ",".join(str(int(t)) for t in free)
    # --ignore-eos wins over --eos-id: all 12 tokens generated and printed
    top1 = ["--eos-id", str(stop), "--ignore-eos", "--sample", "--top-k", "1", "--quiet"]
    assert main([*run, *top1]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == greedy
    drawn = []
    for seed in ("4", "4", "5"):
        hot = ["--ignore-eos", "--temperature", "4.0", "--top-k", "0", "--seed", seed, "--quiet"]
        assert main([*run, *hot]) == 0
        drawn.append(capsys.readouterr().out.splitlines()[-1])
    assert drawn[0] == drawn[1] != drawn[2] and drawn[0] != greedy
