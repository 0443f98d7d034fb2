"""A Gemma 4 reply split into its thought, its answer and its tool calls, as the text arrives.

The released template has the model write `<|channel>thought\\n…<channel|>` before its answer
when thinking is on, and a tool call as `<|tool_call>call:NAME{key:value,…}<tool_call|>`
(values as the template's `format_argument` writes them: strings between `<|"|>` marks, true,
false, numbers, `{…}` and `[…]`, keys bare); the turn ends at `<turn|>`, `<|tool_response>` or
`<eos>` (transformers' response template for gemma4 names the same marks). `Reply` takes the
decoded text in pieces of any length, a piece may end inside a mark, and hands back what it can
already say: each field with the whitespace around it held back (transformers strips it).
"""

import json
import re

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought\n", "<channel|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
QUOTE = '<|"|>'
ENDS = ("<turn|>", "<|tool_response>", "<eos>")
# a state's marks: what each one opens
MARKS = {
    "answer": {THOUGHT_OPEN: "thought", CALL_OPEN: "call", **dict.fromkeys(ENDS, "end")},
    "thought": {THOUGHT_CLOSE: "answer"},
    "call": {CALL_CLOSE: "answer"},
    "end": {},
}


class CallError(ValueError):
    """A tool call's text is not `call:NAME{…}` with arguments the template could write."""


class Reply:
    """The streaming split. `feed(text)` and `finish()` return events: ("thought", text) and
    ("answer", text) pieces (each field's concatenated pieces are the field stripped) and
    ("call", {"name", "arguments"}) once a call closes (`parse_call`; a call that does not
    parse, or that the text ends inside, comes as {"name", "arguments": None, "text"})."""

    def __init__(self):
        self.state, self.pending, self.held = "answer", "", {"thought": "", "answer": ""}
        self.started = {"thought": False, "answer": False}

    def feed(self, text):
        """The next piece of the reply's text → the events it completes."""
        self.pending += text
        events = []
        while self.state != "end":
            mark, at = _first_mark(self.pending, MARKS[self.state])
            if mark is None:
                # a call waits for its close; text keeps back what may begin a mark
                keep = (
                    len(self.pending)
                    if self.state == "call"
                    else _partial_mark(self.pending, MARKS[self.state])
                )
                events += self._text(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            events += self._text(self.pending[:at], closed=True)
            self.pending = self.pending[at + len(mark) :]
            self.state = MARKS[self.state][mark]
        if self.state == "end":
            self.pending = ""
        return events

    def finish(self):
        """The text ended: what was held back (a cut mark is text; a cut call an unparsed one)."""
        if self.state == "call":
            events = [("call", _unparsed(self.pending))]
        else:
            events = self._text(self.pending, closed=True)
        self.pending, self.state = "", "end"
        return events

    def _text(self, text, closed=False):
        """Events for `text` in the current state: a field's piece, or (closed) a call."""
        if self.state == "call":
            return [("call", _call(text))] if closed else []
        if self.state == "end" or not text:
            return []
        return self._stripped(self.state, text)

    def _stripped(self, field, text):
        """A field's new text, its leading whitespace dropped and its trailing whitespace held
        until more text follows."""
        text = self.held[field] + text
        if not self.started[field]:
            text = text.lstrip()
        body = text.rstrip()
        self.held[field] = text[len(body) :]
        if not body:
            return []
        self.started[field] = True
        return [(field, body)]


def _first_mark(text, marks):
    """(the mark that comes first in text, its index), or (None, -1)."""
    found = [(text.find(m), m) for m in marks if m in text]
    if not found:
        return None, -1
    at, mark = min(found)
    return mark, at


def _partial_mark(text, marks):
    """How many characters at text's end begin one of the marks (held until the next piece)."""
    return max((n for m in marks for n in range(1, len(m)) if text.endswith(m[:n])), default=0)


def _call(text):
    """A closed call's text → `parse_call`'s dict, or `_unparsed`'s where it does not parse."""
    try:
        return parse_call(text)
    except CallError:
        return _unparsed(text)


def _unparsed(text):
    """A call that does not parse, or that the reply ended inside: {"name": its name if it
    shows one, "arguments": None, "text": text}."""
    name = re.match(r"\s*call:(\w+)", text)
    return {"name": name and name.group(1), "arguments": None, "text": text}


def parse_call(text):
    """`call:NAME{key:value,…}` → {"name": NAME, "arguments": {key: value, …}}."""
    found = re.fullmatch(r"\s*call:(\w+)(\{.*\})\s*", text, re.S)
    if not found:
        raise CallError(f"{text!r}: expected call:NAME{{key:value,...}}")
    value, end = _value(found.group(2), 0)
    if end != len(found.group(2)):
        raise CallError(f"{text!r}: text after the arguments at {end}")
    return {"name": found.group(1), "arguments": value}


def _value(text, i):
    """One value of a call's arguments starting at text[i] → (the value, the index after it)."""
    i = _blank(text, i)
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise CallError(f"{text!r}: a string at {i} has no closing {QUOTE}")
        return text[i + len(QUOTE) : end], end + len(QUOTE)
    if text.startswith("{", i):
        return _items(text, i + 1, "}", _pair)
    if text.startswith("[", i):
        return _items(text, i + 1, "]", _value)
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    return _scalar(text[i:end].strip(), text, i), end


def _items(text, i, close, item):
    """A mapping's pairs or a list's values from text[i] to `close` → (dict or list, index)."""
    found = []
    i = _blank(text, i)
    while not text.startswith(close, i):
        value, i = item(text, i)
        found.append(value)
        i = _blank(text, i)
        if text.startswith(",", i):
            i = _blank(text, i + 1)
        elif not text.startswith(close, i):
            raise CallError(f"{text!r}: expected ',' or {close!r} at {i}")
    return (dict(found) if close == "}" else found), i + 1


def _pair(text, i):
    """key:value (the key bare or between quote marks) → ((key, value), index)."""
    i = _blank(text, i)
    if text.startswith(QUOTE, i):
        key, i = _value(text, i)
    else:
        end = text.find(":", i)
        key, i = (text[i:end].strip(), end) if end >= 0 else (None, len(text))
    if not key or not text.startswith(":", _blank(text, i)):
        raise CallError(f"{text!r}: expected key:value at {i}")
    value, i = _value(text, _blank(text, i) + 1)
    return (key, value), i


def _scalar(word, text, i):
    """A bare value: true, false, null (or Jinja's None), or a JSON number."""
    named = {"true": True, "false": False, "null": None, "None": None}
    if word in named:
        return named[word]
    try:
        number = json.loads(word)
    except ValueError:
        number = None
    if not isinstance(number, int | float) or isinstance(number, bool):
        raise CallError(f"{text!r}: {word!r} at {i}: expected a string, number, true or false")
    return number


def _blank(text, i):
    """The index of text's first character from i on that is not whitespace."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def split(text):
    """A whole reply's text → {"thought": str or None, "answer": str, "tool_calls": [...]}
    (`Reply`'s events gathered: the fields stripped, an empty thought None)."""
    reply = Reply()
    events = reply.feed(text) + reply.finish()
    fields = {kind: "".join(v for k, v in events if k == kind) for kind in ("thought", "answer")}
    calls = [v for k, v in events if k == "call"]
    return {"thought": fields["thought"] or None, "answer": fields["answer"], "tool_calls": calls}
