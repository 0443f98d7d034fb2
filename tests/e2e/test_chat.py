"""The chat template (`codegen.run.chat`): a prompt with images and videos rendered as one user turn
plus the model's, against transformers' `Gemma4Processor.apply_chat_template
(add_generation_prompt=True)` with the same template and tokenizer: the same text, and the same
ids once expanded and tokenized; and `run --chat` through an export gives transformers' tokens
for the templated prompt; conversations (`run --messages`, `--system`, serve's "messages")
render as transformers renders them on the released Gemma 4 template, and run and serve give
transformers' tokens for one."""

import json
import re
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.utils.chat_template_utils import (
    _alias_reasoning_fields,
    _normalize_chat_messages,
)

from codegen.__main__ import main
from codegen.cli.parser import parser
from codegen.export.command import ExportOptions, export
from codegen.export.defaults import CHAT_TEMPLATE
from codegen.run import chat, commands
from codegen.run.media import read_image
from codegen.run.runtime import RunError, Runner
from ref.gemma4.decoding import Sampling
from ref.gemma4.multimodal import prompt_inputs
from ref.gemma4.prompts import PromptTokens
from tests.hf_processor import WORDS, greedy_with_gap, hf_processor, word_backend, word_tokenizer
from tests.text_oracle import hf_generate, hf_model, text_config
from tests.util import examples, released_template, write_wav

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
    options = dict(budgets=(BUDGET,), seq_len=96, ctx_len=160, full_batch_size=2,
                   hash_shards=False)  # fmt: skip
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
        main(
            [
                "run",
                str(out),
                "--image",
                str(path),
                "--prompt",
                text,
                "--max-new-tokens",
                "8",
                "--greedy",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
    # --no-chat sends the text as it is: other ids, other tokens (the template is what matters)
    plain = ["run", str(out), "--image", str(path), "--prompt", text, "--no-chat", "--greedy"]
    assert main([*plain, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] != ",".join(str(int(t)) for t in want)


def test_run_stops_at_the_end_of_a_turn_and_samples_reproducibly(exported, capsys):
    """A stop id the model emits mid-generation (`--eos-id`) ends `run` where transformers'
    generate ends; two seeds draw other tokens and top-k 1 is greedy."""
    model, out = exported
    ids = [2, 9, 10, 11, 12]
    row = np.array(ids)
    free, _ = hf_generate(model, row, [], [], 12, eos=None)
    stop = int(free[4])
    want, _ = hf_generate(model, row, [], [], 12, eos=stop)
    assert len(want) <= 5
    run = ["run", str(out), "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "12"]
    assert main([*run, "--eos-id", str(stop), "--quiet", "--greedy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == ",".join(str(int(t)) for t in want)
    got = Runner(out, check_shards=False).generate([row], max_new_tokens=12, stop=(stop,))
    np.testing.assert_array_equal(got, want[None])  # ends there: no step after the stop id
    greedy = ",".join(str(int(t)) for t in free)
    # --ignore-eos wins over --eos-id: all 12 tokens generated and printed
    top1 = ["--eos-id", str(stop), "--ignore-eos", "--sample", "--top-k", "1", "--quiet"]
    assert main([*run, *top1]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == greedy
    drawn = []  # (a seed repeats its tokens: test_thinking_tools_and_the_checkpoints_sampling)
    for seed in ("4", "5"):
        hot = ["--ignore-eos", "--temperature", "4.0", "--top-k", "0", "--seed", seed, "--quiet"]
        assert main([*run, *hot]) == 0
        drawn.append(capsys.readouterr().out.splitlines()[-1])
    assert drawn[0] != drawn[1] and greedy not in drawn


# a conversation's media files, by kind (written by `media_folder`)
FILES = {"image": ["photo0.png", "photo1.png"], "video": ["frames"], "audio": ["voice.wav"]}


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory):
    """A folder holding FILES: two photos of other sizes, a folder of frames, a WAV clip."""
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(5)
    for i, name in enumerate(FILES["image"]):
        Image.fromarray(rng.integers(0, 256, (30 - 8 * i, 24, 3), np.uint8)).save(folder / name)
    (folder / "frames").mkdir()
    Image.fromarray(rng.integers(0, 256, (12, 12, 3), np.uint8)).save(folder / "frames" / "0.png")
    write_wav(folder / "voice.wav", rng.integers(-999, 999, 1600), 16000)
    return folder


def words(draw):
    """A few of the tokenizer's words, space-separated."""
    return " ".join(draw(st.lists(st.sampled_from(WORDS[:9]), min_size=1, max_size=4)))


@st.composite
def user_turns(draw, kinds):
    """A user message: words alone as a string, or a list of text items and 0–2 media items of
    `kinds` (a file each, under one of the keys transformers reads) in a drawn order."""
    media = draw(st.lists(st.sampled_from(kinds), max_size=2))
    if not media and draw(st.booleans()):
        return {"role": "user", "content": words(draw)}
    items = [{"type": "text", "text": words(draw)} for _ in range(draw(st.integers(1, 2)))]
    for kind in media:
        key = draw(st.sampled_from(chat.MEDIA_KEYS))
        items.append({"type": kind, key: draw(st.sampled_from(FILES[kind]))})
    return {"role": "user", "content": draw(st.permutations(items))}


TYPES = ("string", "integer", "number", "boolean", "array", "object")


@st.composite
def tools(draw):
    """1–2 tools as JSON schemas (transformers' apply_chat_template(tools=) form)."""
    found = []
    for i in range(draw(st.integers(1, 2))):
        names = draw(st.lists(st.sampled_from(WORDS[:9]), min_size=1, max_size=3, unique=True))
        properties = {n: {"type": draw(st.sampled_from(TYPES)), "description": words(draw)}
                      for n in names}  # fmt: skip
        parameters = {"type": "object", "properties": properties,
                      "required": names[: draw(st.integers(0, len(names)))]}  # fmt: skip
        function = {"name": f"tool{i}", "description": words(draw), "parameters": parameters}
        found.append({"type": "function", "function": function})
    return found


@st.composite
def model_turns(draw, with_tools):
    """The model's earlier turn as a client sends it back: its answer (with or without the
    thought it wrote, which the template drops), or, with tools, a call with its reasoning
    and the tool's response after it."""
    answer = words(draw)
    if draw(st.booleans()):
        answer = f"<|channel>thought\n{words(draw)}<channel|>{answer}"
    if not with_tools or draw(st.booleans()):
        return [{"role": "assistant", "content": answer}]
    arguments = {
        w: draw(st.sampled_from([words(draw), 3, 2.5, True, [1, "a"], {"k": "v"}]))
        for w in draw(st.lists(st.sampled_from(WORDS[:9]), max_size=2, unique=True))
    }
    call = {"id": "c0", "type": "function", "function": {"name": "tool0", "arguments": arguments}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    if draw(st.booleans()):
        turn["reasoning"] = words(draw)
    response = {"role": "tool", "tool_call_id": "c0", "content": words(draw)}
    after = draw(st.sampled_from([[], [{"role": "assistant", "content": answer}]]))
    return [turn, response, *after]


@st.composite
def conversations(draw, kinds=chat.MEDIA, with_tools=False):
    """A system turn (a string or text items) or none, then 1–3 user turns with the model's
    answers between them (with tools: a call and its response among them, or at the end)."""
    messages = []
    if draw(st.booleans()):
        text = words(draw)
        content = draw(st.sampled_from([text, [{"type": "text", "text": text}]]))
        messages.append({"role": "system", "content": content})
    for turn in range(draw(st.integers(1, 3))):
        if turn:
            messages += draw(model_turns(with_tools))
        messages.append(draw(user_turns(kinds)))
    if with_tools and draw(st.booleans()):
        messages += draw(model_turns(with_tools))
    return messages


@st.composite
def asks(draw, kinds=chat.MEDIA):
    """(a conversation, its tools or None, thinking or not)."""
    given = draw(st.none() | tools())
    return draw(conversations(kinds, given is not None)), given, draw(st.booleans())


@pytest.fixture(scope="module")
def released():
    """(the released template, a processor rendering with it)."""
    template = released_template()
    return template, hf_processor(word_tokenizer(), BUDGET, PATCH, chat_template=template)


@settings(max_examples=examples(12), deadline=None)
@given(ask=asks())
def test_conversations_render_as_apply_chat_template(released, media_folder, ask):
    """With tools or without, thinking on or off (transformers given enable_thinking=False, we
    leave it undefined), earlier model turns with their thought, a call and a tool's response."""
    messages, given_tools, thinking = ask
    template, processor = released
    parsed = chat.parse_messages(messages, "drawn", media_folder)
    ours = chat.render(template, parsed, SPECIALS, tools=given_tools, thinking=thinking)
    want = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, tools=given_tools,
        enable_thinking=thinking,
    )  # fmt: skip
    assert ours == want
    assert ("<|think|>" in ours) == thinking and ("<|tool>" in ours) == (given_tools is not None)
    assert chat.media(parsed, "image") == [
        str(media_folder / i[k]) for m in messages if isinstance(m["content"], list)
        for i in m["content"] if i["type"] == "image" for k in chat.MEDIA_KEYS if k in i
    ]  # fmt: skip


@settings(max_examples=examples(4), deadline=None)
@given(ask=asks(kinds=("image",)))
def test_conversation_ids_are_apply_chat_templates(released, media_folder, ask):
    """The rendered conversation expanded with its images read in order of appearance equals
    apply_chat_template(tokenize=True)'s input_ids (images loaded from the same files)."""
    messages, given_tools, thinking = ask
    template, processor = released
    parsed = chat.parse_messages(messages, "drawn", media_folder)
    ids, _, _, _ = prompt_inputs(
        chat.render(template, parsed, SPECIALS, tools=given_tools, thinking=thinking),
        [read_image(p) for p in chat.media(parsed, "image")],
        (),
        patch_size=PATCH,
        pooling_kernel_size=3,
        tokens=TOKENS,
        tokenize=lambda s: word_backend().encode(s, add_special_tokens=False).ids,
        max_soft_tokens=BUDGET,
    )
    want = processor.apply_chat_template(
        parsed, add_generation_prompt=True, tokenize=True, return_dict=True, tools=given_tools,
        enable_thinking=thinking,
    )["input_ids"]  # fmt: skip
    np.testing.assert_array_equal(ids, np.asarray(want).reshape(-1))


@pytest.fixture(scope="module")
def runner(exported):
    """A Runner over the export (serve's requests read against it)."""
    return Runner(exported[1], check_shards=False)


def _hf_inputs(messages, base):
    """apply_chat_template(tokenize=True) on the export's template, media relative to `base`."""
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH, chat_template=CHAT_TEMPLATE)
    return processor.apply_chat_template(
        chat.parse_messages(messages, "test", base), add_generation_prompt=True, tokenize=True,
        return_dict=True, return_tensors="pt",
    )  # fmt: skip


def test_run_and_serve_give_a_conversations_transformers_tokens(exported, runner, tmp_path,
                                                                capsys):  # fmt: skip
    """`run --messages`, a serve request's "messages" and `run --system --prompt` on a
    conversation with an image in its second user turn: transformers' prompt ids (and, but for
    --system, its greedy tokens) for it, on the export's own template."""
    model, out = exported
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 24, 3), np.uint8)).save(
        tmp_path / "photo.png"
    )
    messages = [
        {"role": "system", "content": "look at this"},
        {"role": "user", "content": [{"type": "text", "text": "then that ?"}]},
        {"role": "assistant", "content": "03 04"},
        {"role": "user", "content": [{"type": "image", "path": "photo.png"},
                                     {"type": "text", "text": "and this ?"}]},
    ]  # fmt: skip
    (tmp_path / "chat.json").write_text(json.dumps(messages))
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": messages, "max_new_tokens": 6}))
    run = ["run", str(out), "--max-new-tokens", "6", "--quiet", "--greedy"]
    argv = [*run, "--messages", str(tmp_path / "chat.json")]
    inputs = _hf_inputs(messages, tmp_path)
    np.testing.assert_array_equal(_run_ids(argv, runner), inputs["input_ids"][0].numpy())
    request = commands.read_requests(tmp_path / "r.jsonl", runner)[0]
    np.testing.assert_array_equal(request.ids, inputs["input_ids"][0].numpy())
    want, gap = greedy_with_gap(model, inputs, 6)
    assert gap > 1e-4
    want = ",".join(str(int(t)) for t in want)
    assert main(argv) == 0
    assert capsys.readouterr().out.splitlines()[-1] == want
    assert main(["serve", str(out), "--requests", str(tmp_path / "r.jsonl"), "--greedy"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "request 0: " + want
    system = [*run, "--image", str(tmp_path / "photo.png"), "--system", "look at this"]
    system += ["--prompt", "<|image|> and this ?"]
    short = _hf_inputs(messages[:1] + messages[3:], tmp_path)["input_ids"][0].numpy()
    np.testing.assert_array_equal(_run_ids(system, runner), short)


def _run_ids(argv, runner):
    """The prompt ids `run` sends for its arguments."""
    return commands.inputs(commands.read_run_files(parser().parse_args(argv)), runner)[0][0]


BAD = [  # (messages file text, --requests "messages" or None, the error's words)
    ("[{", None, "expected a JSON list of messages"),
    ("{}", {}, "{}: expected a non-empty list of messages"),
    ('[{"role": "robot", "content": "hi"}]', None,
     'message 0: role "robot": expected one of system, developer, user, assistant, tool'),
    ('[{"content": "hi"}]', None, "message 0: role null: expected one of"),
    ('[{"role": "user", "content": [{"type": "image"}]}]', None,
     "message 0 item 0: .*expected one image/url/path key with a file's path"),
    ('[{"role": "user", "content": [{"type": "image", "path": "gone.png"}]}]', None,
     "message 0 item 0: image file .*gone.png does not exist"),
    ('[{"role": "user", "content": [{"type": "sound"}]}]', None,
     "item 0: .*expected an object whose type is one of text, image, video, audio"),
    ('[{"role": "user", "content": 3}]', None, "content 3: expected a string or a list"),
    ('[{"role": "user", "content": [{"type": "audio", "url": "https://x/a.wav"}]}]', None,
     "item 0: https://x/a.wav: expected a local file's path, not a URL"),
]  # fmt: skip


@pytest.mark.parametrize("text, request_messages, words", BAD)
def test_bad_conversations_are_one_line_and_exit_2(exported, runner, tmp_path, capsys, text,
                                                   request_messages, words):  # fmt: skip
    """A bad --messages file is one line naming the file, the message and item, and what was
    expected, and exit code 2; a request's bad "messages" names its line the same way."""
    path = tmp_path / "chat.json"
    path.write_text(text)
    assert main(["run", str(exported[1]), "--messages", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(f"--messages {re.escape(str(path))}: .*{words}", err), err
    messages = json.loads(text) if request_messages is None and text != "[{" else request_messages
    if messages is not None:
        (tmp_path / "r.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
        with pytest.raises(chat.ChatError, match=r"r.jsonl line 1: messages: .*" + words):
            commands.read_requests(tmp_path / "r.jsonl", runner)


def test_messages_refuse_other_prompt_options(exported, runner, tmp_path, capsys):
    _, out = exported
    path = tmp_path / "chat.json"
    path.write_text('[{"role": "user", "content": "look"}]')
    run = ["run", str(out), "--messages", str(path)]
    assert main([*run, "--prompt", "look", "--no-chat"]) == 2
    assert "--messages holds the whole conversation and its media: expected no --prompt, " \
        "--no-chat" in capsys.readouterr().err  # fmt: skip
    assert main(["run", str(out), "--system", "be brief", "--prompt-ids", "2,9"]) == 2
    assert "--system TEXT: expected with --prompt" in capsys.readouterr().err
    line = {"messages": [{"role": "user", "content": "look"}], "prompt": "look"}
    (tmp_path / "r.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(RunError, match="line 1: messages holds the whole conversation"):
        commands.read_requests(tmp_path / "r.jsonl", runner)


def test_messages_are_normalized_as_transformers_does():
    """Keys whose value is null dropped, reasoning copied to `thinking` and
    `reasoning_content`: what transformers hands its template."""
    messages = [
        {"role": "user", "content": "look", "name": None},
        {"role": "assistant", "content": "at", "reasoning": "this", "tool_calls": None},
    ]
    want = _alias_reasoning_fields(_normalize_chat_messages(messages))
    assert chat.parse_messages(messages, "test", ".") == want


TOOLS = [{"type": "function", "function": {
    "name": "tool0", "description": "look at the photo",
    "parameters": {"type": "object", "properties": {"what": {"type": "string"}}},
}}]  # fmt: skip
# Gemma 4's instruct sampling (../shared/gemma4/SOURCE.md), the stop id the tiny model's
SAMPLING = {"eos_token_id": 1, "do_sample": True, "temperature": 1.0, "top_k": 64, "top_p": 0.95}


@pytest.fixture(scope="module")
def released_export(exported, tmp_path_factory):
    """A copy of the export holding the released template and generation_config.json that
    samples as the released instruct checkpoints do."""
    folder = tmp_path_factory.mktemp("released") / "out"
    shutil.copytree(exported[1], folder)
    (folder / "chat_template.jinja").write_text(released_template())
    (folder / "generation_config.json").write_text(json.dumps(SAMPLING))
    return folder


def test_thinking_tools_and_the_checkpoints_sampling(released_export, tmp_path, capsys):
    """`run --messages --tools --thinking` and a serve request's "tools" and "thinking" send
    apply_chat_template(tools=, enable_thinking=True)'s ids; run samples as generation_config
    says, printing its seed (which repeats it), --greedy gives the greedy tokens; serve prints
    a thinking request's reply split, then its ids."""
    messages = [{"role": "system", "content": "look at this"},
                {"role": "user", "content": "then that ?"}]  # fmt: skip
    (tmp_path / "chat.json").write_text(json.dumps(messages))
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    line = {"messages": messages, "tools": TOOLS, "thinking": True, "max_new_tokens": 4}
    (tmp_path / "r.jsonl").write_text(json.dumps(line))
    runner = Runner(released_export, check_shards=False)
    processor = hf_processor(word_tokenizer(), BUDGET, PATCH, chat_template=released_template())
    want = np.reshape(processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, tools=TOOLS, enable_thinking=True
    ), -1)  # fmt: skip
    run = ["run", str(released_export), "--messages", str(tmp_path / "chat.json"), "--tools",
           str(tmp_path / "tools.json"), "--thinking", "--max-new-tokens", "4",
           "--quiet"]  # fmt: skip
    np.testing.assert_array_equal(_run_ids(run, runner), want)
    request = commands.read_requests(tmp_path / "r.jsonl", runner)[0]
    np.testing.assert_array_equal(request.ids, want)
    assert request.sampling == Sampling(1.0, 64, 0.95, request.sampling.seed)
    assert main(run) == 0
    out, err = capsys.readouterr()
    seed = re.fullmatch(r"run: sampling: temperature 1.0, top_k 64, top_p 0.95, seed (\d+) "
                        r"\(--seed \1 repeats it, --greedy turns sampling off\)\n",
                        err)  # fmt: skip
    assert seed, err
    assert main([*run, "--seed", seed.group(1)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == out.splitlines()[-1]
    greedy = runner.generate([np.asarray(want)], max_new_tokens=4)[0]
    assert main([*run, "--greedy"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == ",".join(map(str, commands.unpadded(greedy, runner.stop)))
    assert err == ""
    assert main(["serve", str(released_export), "--requests", str(tmp_path / "r.jsonl"),
                 "--seed", "5"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    reply, ids = out.splitlines()
    assert reply.startswith("request 0 reply: ") and ids.startswith("request 0: ")
    assert set(json.loads(reply.removeprefix("request 0 reply: "))) == {
        "thought", "answer", "tool_calls"}  # fmt: skip
    assert "request 0: sampling: temperature 1.0, top_k 64, top_p 0.95, seed 5" in err


RUN = ["run", "--prompt", "look"]
BAD_ASKS = [  # (the command and its arguments but the folder, T's text or None, the error's words)
    ([*RUN, "--tools", "T"], "[{", "--tools .*T: expected a JSON list of tools"),
    ([*RUN, "--tools", "T"], "{}", "--tools .*T: {}: expected a non-empty list of tools"),
    ([*RUN, "--tools", "T"], '[{"name": "f"}]', 'tool 0: {"name": "f"}: expected {"type"'),
    ([*RUN, "--thinking"], None, "--thinking: expected a chat template that reads "
     r"enable_thinking \(it never reads enable_thinking\)"),
    ([*RUN, "--thinking", "--no-chat"], None, "--thinking: .*no chat template is used"),
    ([*RUN, "--greedy", "--top-k", "3"], None, "--greedy turns sampling off: expected no --top-k"),
    (["serve", "--requests", "T"], '{"prompt": "look", "thinkng": true}',
     "--requests .*T line 1: unknown key 'thinkng': expected keys among prompt, "),
]  # fmt: skip


@pytest.mark.parametrize("argv, text, words", BAD_ASKS)
def test_bad_asks_are_one_line_and_exit_2(exported, tmp_path, capsys, argv, text, words):
    """On the export's own template (which reads neither tools nor enable_thinking)."""
    if text is not None:
        (tmp_path / "T").write_text(text)
    argv = [str(tmp_path / "T") if a == "T" else a for a in argv]
    assert main([argv[0], str(exported[1]), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(words, err), err


@pytest.mark.parametrize(
    "line, words",
    [({"prompt": "look", "thinkng": True}, "line 1: unknown key 'thinkng': expected keys among"),
     ({"prompt": "look", "thinking": "yes"}, "line 1: thinking='yes': expected true or false"),
     ({"prompt": "look", "tools": {}}, "line 1: tools: {}: expected a non-empty list of tools"),
     ({"prompt": "look", "greedy": True, "sample": True}, "line 1: greedy turns sampling off"),
     ([1], "line 1: .1.: expected a JSON object")],
)  # fmt: skip
def test_bad_requests_are_refused(runner, tmp_path, line, words):
    """(serve's exit 2 and one line: `test_bad_asks_are_one_line_and_exit_2`'s last case)"""
    (tmp_path / "r.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=words):
        commands.read_requests(tmp_path / "r.jsonl", runner)
