"""The streaming interface every tool-call parser shares.

A parser is fed the model's text in deltas and returns events in output order:
`TextDelta` for plain content, then for each call a `ToolCallStart` (index, id,
name) followed by `ToolCallArguments` (a JSON text chunk). Non-streaming use is
the same parser fed everything and finished.

Design rules:
- Markup never leaks: text that may be the start of a marker is held back until
  the marker is ruled in or out.
- A call is released only once it is complete and valid, so a malformed call can
  still fall back to plain text (as the model wrote it). Its arguments follow as
  one chunk; clients accumulate chunks, as they do for OpenAI's.
- Whitespace that only separates content from a call is dropped (models put
  newlines around their calls); other text passes through untouched.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kvfork.server.toolcalls.grammar_pieces import CallGrammar


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    text: str  # a chunk of the arguments' JSON text


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArguments


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None  # the model's own id for the call (Kimi's `functions.NAME:0`): its template renders it back


def openai_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def arguments_json(arguments: dict[str, Any]) -> str:
    # Same rendering as the chat templates' `tojson`, so a resent call re-renders
    # to the text the client got.
    return json.dumps(arguments, ensure_ascii=False)


# Whitespace held back in case a call follows (text before a call then ends without it): "\n\n"
# and a little indentation, no more.
MAX_HELD_WS = 4


class ToolParser:
    """Base: holds the event bookkeeping; subclasses decide where calls are.

    A family's module also says how its calls are constrained (server/generate/grammar.py joins them):
    `call_grammar` writes one call to one function, `separator` goes between parallel calls, `block`
    wraps a turn's calls where the family writes them in one (Kimi's section), and `trigger` is the text
    that opens a call when tool_choice is auto (None: the whole reply is calls).
    `special_markers` are its markup pieces that may be special tokens of the model's tokenizer: the
    detokenizer keeps them in the text (server/text/tokenizer.py) so the parser can see them.
    """

    name = ""
    parse_calls = True  # False: the parser reads the reply's structure (Harmony's channels) but no calls
    constrains_auto = True  # tool_choice auto gets a grammar that holds the calls the model opens
    separator = "\n"
    block = ("", "")
    trigger: str | None = None
    special_markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None, make_id: Callable[[], str] = openai_call_id):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or () if t.get("type") == "function"}
        self.make_id = make_id
        self.calls = 0
        self._pending_ws = ""  # trailing whitespace of released text, held in case a call follows
        self._after_call = False

    @classmethod
    def prepare(cls) -> None:
        """Load what the family's parser needs, at start rather than in the first request."""

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def opening(self, name: str | None) -> str:
        """Text that starts a call (to `name`, when given): appended to the prompt to force one."""
        raise NotImplementedError

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        """One call to `function` (the tools' `index`th) in this family's markup, its arguments held to the
        function's parameters."""
        raise NotImplementedError

    def _calls(self, calls: list[ParsedCall], out: list[Event]) -> None:
        self._pending_ws, self._after_call = "", True
        for call in calls:
            out.append(ToolCallStart(self.calls, call.id or self.make_id(), call.name))
            out.append(ToolCallArguments(self.calls, arguments_json(call.arguments)))
            self.calls += 1

    def _text(self, text: str, out: list[Event]) -> None:
        core = text.rstrip()
        if not core:
            self._hold_ws(self._pending_ws + text, out)
            return
        head = self._pending_ws + core
        if self._after_call:
            head, self._after_call = head.lstrip(), False
        out.append(TextDelta(head))
        self._hold_ws(text[len(core):], out)

    def _hold_ws(self, ws: str, out: list[Event]) -> None:
        """Keep at most MAX_HELD_WS characters of trailing whitespace back (the blank line a call's
        markup may follow), so a model that writes whitespace still streams."""
        cut = max(0, len(ws) - MAX_HELD_WS)
        if cut and not self._after_call:  # after a call, leading whitespace is dropped anyway
            out.append(TextDelta(ws[:cut]))
        self._pending_ws = ws[cut:]

    def _flush_ws(self, out: list[Event]) -> None:
        if not self._after_call and self._pending_ws:
            out.append(TextDelta(self._pending_ws))
        self._pending_ws = ""


class MarkupToolParser(ToolParser):
    """Calls delimited by markers: `markers` pairs each opening marker with its closing one.

    Subclasses implement `parse_call(opening, body)`: the calls in a body, or
    None when it is malformed.
    """

    markers: tuple[tuple[str, str], ...] = ()
    unclosed_is_text = False  # True: a call the reply ends inside of is text, however much of it parses

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.markers and "trigger" not in cls.__dict__:
            cls.trigger = cls.markers[0][0]

    def __init__(self, tools: list[dict] | None = None, make_id: Callable[[], str] = openai_call_id):
        super().__init__(tools, make_id)
        self._buffer = ""  # text not yet released
        self._open: tuple[str, str] | None = None  # the markers of the call being read
        self._searched = 0  # how far the open call's body is known to hold no closing marker

    def parse_call(self, opening: str, body: str) -> list[ParsedCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while True:
            if self._open:
                if not self._open[1]:  # no closing marker: the calls run to the end of the reply
                    break
                at = self._buffer.find(self._open[1], self._searched)
                if at < 0:  # a long call is searched once, not again on every delta
                    self._searched = max(0, len(self._buffer) - len(self._open[1]) + 1)
                    break
                self._searched = 0
                body, self._buffer = self._buffer[:at], self._buffer[at + len(self._open[1]):]
                self._close(body, closed=True, out=out)
            else:
                found = [(at, pair) for pair in self.markers if (at := self._buffer.find(pair[0])) >= 0]
                if not found:
                    break
                at, pair = min(found, key=lambda f: f[0])
                self._text(self._buffer[:at], out)
                self._buffer, self._open = self._buffer[at + len(pair[0]):], pair
        if not self._open:
            keep = max(held_prefix(self._buffer, opening) for opening, _ in self.markers)
            ready, self._buffer = self._buffer[: len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            self._text(ready, out)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._open:
            self._close(self._buffer, closed=False, out=out)
        else:
            self._text(self._buffer, out)
        self._buffer = ""
        self._flush_ws(out)
        return out

    def _close(self, body: str, closed: bool, out: list[Event]) -> None:
        assert self._open
        opening, closing = self._open
        self._open = None
        calls = None if self.unclosed_is_text and closing and not closed else self.parse_call(opening, body)
        if calls is None:  # malformed: the model's text, markup and all
            self._text(opening + body + (closing if closed else ""), out)
        else:
            self._calls(calls, out)


def json_object(text: str) -> Any:
    """The JSON value in `text`, or None when it is not valid JSON or nests deeper than Python's JSON reader
    recurses (RecursionError: model text, so broken markup, never a server error)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def call_from_json(value: Any) -> ParsedCall | None:
    """A call from `{"name": ..., "arguments"|"parameters": {...}}`; arguments may be a JSON string."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        args = json_object(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], args)
