"""`codegen.run.reply`: a Gemma 4 reply split into thought, answer and tool calls, against
transformers' own parser of Gemma 4 replies (`parse_response` with the gemma4 response template
its server falls back to) on drawn replies fed in drawn pieces, a piece ending anywhere (inside
a mark too); the calls' arguments written as the released template's `format_argument` writes
them come back as they were drawn."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
from transformers.utils.chat_parsing.response_parser import parse_response

from codegen.run import chat
from codegen.run.reply import CallError, Reply, parse_call, split
from tests.strategies import KEYS, QUOTE, VALUES, replies, written
from tests.util import examples, released_template

GEMMA4 = _RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)]
MARKS = ("<|channel>thought\n", "<channel|>", "<|tool_call>", "<turn|>", "<|tool_response>")


def fed(text, cuts):
    """Reply's events for `text` fed in pieces cut at `cuts`, gathered as `split` gathers them."""
    reply, events, at = Reply(), [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        events += reply.feed(text[at:cut])
        at = cut
    events += reply.finish()
    fields = {kind: "".join(v for k, v in events if k == kind) for kind in ("thought", "answer")}
    calls = [v for k, v in events if k == "call"]
    return {"thought": fields["thought"] or None, "answer": fields["answer"], "tool_calls": calls}


def transformers_split(text):
    """transformers' parse of a reply, in `split`'s shape."""
    parsed = parse_response(text, GEMMA4, prefix="<|turn>model\n")
    calls = [c["function"] for c in parsed.get("tool_calls", [])]
    thought = parsed.get("reasoning_content") or None
    return {"thought": thought, "answer": parsed.get("content", ""), "tool_calls": calls}


@settings(max_examples=examples(60), deadline=None)
@given(drawn=replies(), data=st.data())
def test_a_reply_in_pieces_is_transformers_split(drawn, data):
    """Exact: the fields stripped as transformers strips them, the calls' arguments equal (and
    equal to the drawn ones), for every way of cutting the text into pieces."""
    text, thought, answer, calls = drawn
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got = fed(text, cuts)
    assert got == transformers_split(text) == split(text)
    assert got["tool_calls"] == calls
    assert got["answer"] == answer.strip()


@settings(max_examples=examples(60), deadline=None)
@given(drawn=replies(), data=st.data())
def test_a_reply_cut_anywhere_is_split_alike_in_any_pieces(drawn, data):
    """A stream that ends anywhere (inside a mark, a thought, a call): the same split whatever
    the pieces; transformers' where it parses it (it refuses a call cut short, which comes
    back with arguments None and its text); a cut mark is text, never lost."""
    text = drawn[0][: data.draw(st.integers(0, len(drawn[0])))]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    got = fed(text, cuts)
    assert got == split(text)
    if text.count("<|tool_call>") > text.count("<tool_call|>"):  # inside a call
        assert got["tool_calls"][-1]["arguments"] is None
        assert text.endswith(got["tool_calls"][-1]["text"])
        return
    cut = max((n for m in MARKS for n in range(1, len(m)) if text.endswith(m[:n])), default=0)
    if cut:  # the cut mark ends the open field (transformers drops what came before it)
        assert any((got[f] or "").endswith(text[-cut:].strip()) for f in ("answer", "thought"))
    else:
        assert got == transformers_split(text)


def test_marks_cut_between_pieces():
    """A mark split over pieces is held until it shows whole, and text up to it goes out."""
    reply = Reply()
    assert reply.feed("so <|chan") == [("answer", "so")]
    assert reply.feed("nel>thought\nhm") == [("thought", "hm")]
    assert reply.feed("m<chan") == [("thought", "m")]
    assert reply.feed("nel|>ok <|tool_call>call:f{x:") == [("answer", " ok")]  # "so ok"
    assert reply.feed("1}<tool_call|><|tool_response>more") == [
        ("call", {"name": "f", "arguments": {"x": 1}})
    ]
    assert reply.finish() == []
    assert split("ok<|channel>thou") == {"thought": None, "answer": "ok<|channel>thou",
                                         "tool_calls": []}  # fmt: skip


@pytest.mark.parametrize(
    "text, words",
    [("f{x:1}", "expected call:NAME"), ("call:f{x:1}}", "text after the arguments"),
     ("call:f{x:" + QUOTE + "a}", "no closing"), ("call:f{x:1;y:2}", "expected a string, number"),
     ("call:f{:1}", "expected key:value"), ("call:f{x:1 y}", "expected a string, number")],
)  # fmt: skip
def test_calls_that_do_not_parse_say_where(text, words):
    with pytest.raises(CallError, match=words):
        parse_call(text)
    assert split(f"<|tool_call>{text}<tool_call|>")["tool_calls"][0]["arguments"] is None


@settings(max_examples=examples(10), deadline=None)
@given(calls=st.lists(st.tuples(KEYS, st.dictionaries(KEYS, VALUES, max_size=3)), min_size=1,
                      max_size=2))  # fmt: skip
def test_the_released_template_writes_calls_as_the_tests_write_them(calls):
    """The released template renders an assistant turn's tool_calls as `written` does (the
    drawn replies above are what the model is shown to write)."""
    template = released_template()
    tool_calls = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": tool_calls}]  # fmt: skip
    text = chat.render(template, messages, {"bos_token": "<bos>"}, add_generation_prompt=False)
    want = "".join(f"<|tool_call>call:{n}{written(a)}<tool_call|>" for n, a in calls)
    assert text.endswith("<|turn>model\n" + want + "<|tool_response>")
