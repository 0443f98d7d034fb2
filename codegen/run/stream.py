"""`run`'s output as it arrives: row 0's text printed to stdout token by token, or, when the
prompt asked for thinking or tools, split (`codegen.run.reply.Reply`): the thought streamed to
stderr after "thought: ", the answer to stdout, each tool call as a line of JSON
(`tool call: {"name": ..., "arguments": {...}}`)."""

import json
import sys

from codegen.run.reply import Reply


def row_text(tokenizer, row):
    """A generated row's decoded text, or a visible note when the ids decode to nothing (ids
    past tokenizer.json's vocabulary, or tokens whose text is empty)."""
    text = tokenizer.decode([int(t) for t in row], skip_special_tokens=False)
    if not text.strip():
        return f"(no text: the {len(row)} ids decode to {text!r})"
    return text


def call_line(call):
    """A tool call as `run` prints it: "tool call: " and its JSON."""
    return "tool call: " + json.dumps(call, ensure_ascii=False)


class Stream:
    """Row 0's text printed as its tokens arrive: the whole row decoded again at each token and
    the new end passed on, held back while it ends in an incomplete character (a byte token of
    a longer UTF-8 sequence decodes to U+FFFD), as transformers' TextStreamer does. split: the
    text goes through `Reply` (thought, answer, tool calls) instead of straight to stdout."""

    def __init__(self, tokenizer, split=False):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.reply = Reply() if split else None
        self.line = {"thought": False, "answer": False}  # a field's line left open
        self.said = False

    def __call__(self, row, token):
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        if self.reply is None and not text.strip():
            return  # only whitespace yet: held (a row of no text gets `row_text`'s note alone)
        new, self.shown = text[len(self.shown) :], text
        if self.reply is None:
            print(new, end="", flush=True)
        else:
            self._show(self.reply.feed(new))

    def _show(self, events):
        """Print a Reply's events: thought to stderr, answer to stdout, calls as lines."""
        for kind, value in events:
            self.said = True
            if kind == "call":
                self._close()
                print(call_line(value), flush=True)
                continue
            self._close(keep=kind)
            out = sys.stderr if kind == "thought" else sys.stdout
            if not self.line[kind]:
                print("thought: " if kind == "thought" else "", end="", file=out)
            print(value, end="", file=out, flush=True)
            self.line[kind] = True

    def _close(self, keep=None):
        """End the open lines of the fields other than `keep`."""
        for kind, open_ in self.line.items():
            if open_ and kind != keep:
                print(file=sys.stderr if kind == "thought" else sys.stdout, flush=True)
                self.line[kind] = False

    def finish(self, row):
        """End the streamed output: what is left of the row's text, or the note `row_text` gives
        for a row without text."""
        text = row_text(self.tokenizer, row)
        if self.reply is not None:
            self._show(self.reply.finish())
            self._close()
            if not self.said:
                print(text)
            return
        if not self.shown.strip():
            print(text)
            return
        print(text[len(self.shown) :] if text.startswith(self.shown) else "", flush=True)
