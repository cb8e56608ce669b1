"""Llama 3.1 / 3.2 JSON calls: the whole reply is `{"name": ..., "parameters": {...}}`.

The reply may open with `<|python_tag|>` and hold several calls separated by
`;`. A reply that starts with anything else is plain content. One that starts
like a call is held until it is ruled in or out: a call only counts when its
JSON is complete and names a function; anything else falls back to text.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvfork.server.toolcalls.base import Event, ParsedCall, ToolParser, call_from_json, held_prefix
from kvfork.server.toolcalls.lark import CallGrammar, json_value, parameters

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3Parser(ToolParser):
    name = "llama3"
    separator = "; "
    special_markers = (PYTHON_TAG,)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._buffer = ""
        self._mode = "undecided"  # then "text" or "calls"
        self._done = 0  # how much of the buffer is parsed into released calls

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
            skipped = len(rest) - len(head)
            call = self._next_call(head)
            if call is None:
                if final or not head.startswith("{") or self._complete(head):
                    self._buffer = rest
                    self._to_text(out)
                return
            parsed, length = call
            self._calls([parsed], out)
            self._done += skipped + length

    @staticmethod
    def _next_call(head: str) -> tuple[ParsedCall, int] | None:
        try:
            value, length = _DECODER.raw_decode(head)
        except ValueError:
            return None
        call = call_from_json(value)
        return None if call is None else (call, length)

    @staticmethod
    def _complete(head: str) -> bool:
        """True when `head` opens with a complete JSON value (that was not a call)."""
        try:
            _DECODER.raw_decode(head)
        except ValueError:
            return False
        return True
