"""`codegen.run.stream.Stream` with the reply split (`run --thinking`/`--tools`): a drawn
reply's tokens arriving one by one print the thought to stderr after "thought: ", the answer
alone to stdout, then each call as a `tool call: ` line of JSON; without the split, the text
as it is."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.run.stream import Stream
from tests.strategies import replies


class Pieces:
    """A stand-in tokenizer: id i decodes to pieces[i], a row to their concatenation."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)


def streamed(text, cuts, split):
    """Stream's output for `text` cut into tokens at `cuts`."""
    bounds = [0, *sorted(set(cuts) - {0, len(text)}), len(text)]
    tokenizer = Pieces([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    stream = Stream(tokenizer, split)
    ids = list(range(len(tokenizer.pieces)))
    for i in ids:
        stream([], i)
    stream.finish(ids)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drawn=replies(), data=st.data())
def test_a_split_stream_prints_each_field_on_its_channel(drawn, data, capsys):
    text, thought, answer, calls = drawn
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    streamed(text, cuts, split=True)
    out, err = capsys.readouterr()
    thought = (thought or "").strip()
    assert err == (f"thought: {thought}\n" if thought else "")
    answer = answer.strip()
    if thought or answer or calls:  # the answer's line(s), then a line per call
        assert out.startswith(answer + "\n" * bool(answer))
        said = out[len(answer) + bool(answer) :].splitlines(keepends=True)
        assert all(line.startswith("tool call: ") and line.endswith("\n") for line in said)
        assert [json.loads(line.removeprefix("tool call: ")) for line in said] == calls
    else:  # nothing said: a visible line all the same (the row's text, or the note for none)
        assert out.strip() and out.endswith("\n")
    streamed(text, cuts, split=False)
    plain = capsys.readouterr().out
    assert plain == text + "\n" if text.strip() else plain.startswith("(no text: ")


def test_a_row_of_whitespace_prints_the_note_alone(capsys):
    """Whitespace is held until visible text follows: a row of only whitespace prints
    `row_text`'s note and nothing before it (a draw of " " once printed " (no text: …)")."""
    for text, cuts in ((" ", []), ("\n \n", [1, 2])):
        streamed(text, cuts, split=False)
        assert capsys.readouterr().out == f"(no text: the {len(cuts) + 1} ids decode to {text!r})\n"
