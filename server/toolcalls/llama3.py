"""Llama 3.1 / 3.2 JSON calls: the whole reply is `{"name": ..., "parameters": {...}}`.

The reply may open with `<|python_tag|>` and hold several calls separated by
`;`. A reply that starts with anything else is plain content. One that starts
like a call is held until it is ruled in or out: a call only counts when its
JSON is complete and names a function; anything else falls back to text.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from kvfork.server.toolcalls.base import Event, ParsedCall, ToolParser, call_from_json, held_prefix
from kvfork.server.toolcalls.grammar_pieces import CallGrammar, json_value, parameters

PYTHON_TAG = "<|python_tag|>"
# Deeper than any call's arguments: past it the reply is text, before Python's JSON reader recurses that deep.
MAX_DEPTH = 128


class Llama3Parser(ToolParser):
    name = "llama3"
    separator = "; "
    special_markers = (PYTHON_TAG,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffer = ""
        self._mode = "undecided"  # then "text" or "calls"
        self._done = 0  # how much of the buffer is parsed into released calls
        self._object = _ObjectEnd()  # where the call being read closes

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._mode == "text":
            self._text(text, out)
            return out
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if not head or (held_prefix(head, PYTHON_TAG) == len(head)):
                return out
            if head.startswith(("{", PYTHON_TAG)):
                self._mode, self._done = "calls", len(self._buffer) - len(head)
            else:
                self._to_text(out)
                return out
        if "}" in text:
            self._release(out, final=False)
        return out

    def opening(self, name: str | None) -> str:
        return '{"name": ' + (json.dumps(name, ensure_ascii=False) + ', "parameters": ' if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        return CallGrammar('{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "parameters": ',
                           json_value(parameters(function), function), "}")

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._mode == "calls":
            self._release(out, final=True)
        elif self._mode == "undecided":
            self._to_text(out)
        self._flush_ws(out)
        return out

    def _to_text(self, out: list[Event]) -> None:
        self._mode = "text"
        self._text(self._buffer, out)
        self._buffer = ""

    def _release(self, out: list[Event], final: bool) -> None:
        """Release every complete call; at the end (or on junk) the rest becomes text."""
        while True:
            rest = self._buffer[self._done :]
            head = rest.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG) :].lstrip()
            if self.calls and head.startswith(";"):
                head = head[1:].lstrip()
            if not head:
                return
            start = self._done + len(rest) - len(head)
            end = self._object.end(self._buffer, start) if head.startswith("{") else None
            call = None if end is None or end < 0 else _call(self._buffer[start:end])
            if call is None:
                if final or end is not None or not head.startswith("{"):  # junk, JSON that is no call, too deep
                    self._buffer = rest
                    self._to_text(out)
                return
            self._calls([call], out)
            self._done = end


class _ObjectEnd:
    """Where the JSON object opening at a position of a growing buffer closes, each character read once however
    many times it is asked (a call's JSON is decoded once, when it has closed): linear in the reply."""

    STRUCTURE = re.compile(r'[{}\[\]"\\]')

    def __init__(self) -> None:
        self.start = self.at = -1
        self.depth, self.in_string = 0, False

    def end(self, buffer: str, start: int) -> int | None:
        """The index past the object's closing brace; None while it is open; -1 when it nests deeper than
        MAX_DEPTH (no call: its text is the model's)."""
        if start != self.start:
            self.start, self.at, self.depth, self.in_string = start, start, 0, False
        while (m := self.STRUCTURE.search(buffer, self.at)) is not None:
            c, self.at = m.group(), m.end()
            if self.in_string:
                if c == "\\":
                    if self.at == len(buffer):  # what it escapes has not come yet
                        self.at -= 1
                        return None
                    self.at += 1
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
                if self.depth > MAX_DEPTH:
                    return -1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return self.at
        self.at = len(buffer)
        return None


def _call(text: str) -> ParsedCall | None:
    """The call `text` (one whole JSON object) makes, or None: not JSON, or no call."""
    try:
        return call_from_json(json.loads(text))
    except (ValueError, RecursionError):
        return None
