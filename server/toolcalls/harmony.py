"""gpt-oss's Harmony format: the reply is a series of messages, each on a channel.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>
    ... or <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

`analysis` is reasoning, `final` is content, and a message to `functions.NAME`
(on `commentary`; the recipient may stand before the channel or after it) is a
call whose body is its JSON arguments. A commentary message to no one is a
preamble the user may read: content. The prompt ends with `<|start|>assistant`,
so the reply opens with a message's header.

The markup is read from the text, with the model's own special tokens kept by
the detokenizer (server/text/tokenizer.py), so no Harmony encoding is needed:
openai-harmony fetches its encoding file at run time, which a machine that
reaches only package registries cannot do. `<|call|>` and `<|return|>` are
end-of-sequence tokens that may never reach the text: the end of the reply
closes the message it is in.

Constrained calls are written as gpt-oss's template writes past calls, so a
resent call renders to the tokens the model wrote.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from kvfork.server.toolcalls.base import (
    Event,
    ParsedCall,
    ReasoningDelta,
    TextDelta,
    ToolParser,
    held_prefix,
    json_object,
)
from kvfork.server.toolcalls.grammar_pieces import CallGrammar, json_value, parameters

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)  # what ends a message's body
MARKERS = (START, CHANNEL, MESSAGE, "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
_RECIPIENT = re.compile(r"to=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
MAX_HEADER = 256  # characters: a header longer than this is not one (the model wrote plain text)


def _header(text: str) -> tuple[str, str | None] | None:
    """(channel, recipient) of a message header, or None when `text` is not one."""
    channel = _CHANNEL.search(text)
    if channel is None:
        return None
    recipient = _RECIPIENT.search(text)
    return channel.group(1), recipient.group(1) if recipient else None


class HarmonyParser(ToolParser):
    name = "harmony"
    separator = START + "assistant"  # each call is a message of its own
    trigger = None
    special_markers = MARKERS
    constrains_auto = False  # channels come and go: only a forced call is constrained

    def __init__(self, *args: Any, calls: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.parse_calls = calls  # False: a message to a function is content, as the model wrote it
        self._buffer = ""
        self._header: tuple[str, str | None] | None = None  # the open message's (channel, recipient)
        self._raw = False  # the reply is not Harmony: everything is content
        self._searched = 0  # how far the open message's body is known to hold no end marker

    def opening(self, name: str | None) -> str:
        return " to=functions." + (f"{name}{CHANNEL}commentary json{MESSAGE}" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        return CallGrammar(f" to=functions.{function['name']}{CHANNEL}commentary json{MESSAGE}",
                           json_value(parameters(function), function), "<|call|>")

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._raw:
            self._text(text, out)
            return out
        self._buffer += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        while self._step(out, final=True):
            pass
        if self._header is not None:
            self._close(self._buffer, out)
        elif self._buffer.strip() and not self._raw:
            self._text(self._buffer, out)  # a header the reply never finished: the text as written
        self._buffer = ""
        self._flush_ws(out)
        return out

    def _step(self, out: list[Event], final: bool) -> bool:
        """Move on by one header or message body; False when the buffer holds no more to decide."""
        if self._header is None:
            at = self._buffer.find(MESSAGE)
            if at < 0:
                if not final and self._could_be_header(self._buffer):
                    return False
                if self._buffer.strip():
                    self._raw = True
                    self._text(self._buffer, out)
                    self._buffer = ""
                return False
            header = _header(self._buffer[:at])
            if header is None:
                self._raw = True
                self._text(self._buffer, out)
                self._buffer = ""
                return False
            self._header, self._buffer = header, self._buffer[at + len(MESSAGE):]
            return True
        found = [(at, end) for end in ENDS if (at := self._buffer.find(end, self._searched)) >= 0]
        if found:
            at, end = min(found)
            body, self._buffer = self._buffer[:at], self._buffer[at + (0 if end == START else len(end)):]
            self._searched = 0
            self._close(body, out)
            return True
        if not self._is_call():  # reasoning and content stream; a call's body is held until it ends
            keep = max(held_prefix(self._buffer, end) for end in ENDS)
            self._body(self._buffer[:len(self._buffer) - keep], out)
            self._buffer = self._buffer[len(self._buffer) - keep:]
        # a long call's body is searched once, not again on every delta
        self._searched = max(0, len(self._buffer) - max(map(len, ENDS)) + 1)
        return False

    def _could_be_header(self, text: str) -> bool:
        head = text.lstrip()
        if len(text) > MAX_HEADER:
            return False
        return not head or any(head.startswith(m) or m.startswith(head) for m in (START, CHANNEL, " to=", "to="))

    def _is_call(self) -> bool:
        assert self._header is not None
        recipient = self._header[1]
        return self.parse_calls and recipient is not None and recipient.startswith("functions.")

    def _body(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        assert self._header is not None
        if self._header[0] == "analysis":
            out.append(ReasoningDelta(text))
        else:
            self._text(text, out)

    def _close(self, body: str, out: list[Event]) -> None:
        assert self._header is not None
        if self._is_call():
            name = self._header[1][len("functions."):]  # type: ignore[index]
            arguments = json_object(body.strip())
            if isinstance(arguments, dict) and name in self.tools:
                self._calls([ParsedCall(name, arguments)], out)
            else:  # broken: the message as the model wrote it
                self._text(f"to={self._header[1]} {body}", out)
        else:
            self._body(body, out)
        self._header = None


def harmony_template(chat_template: str | None) -> bool:
    return CHANNEL in (chat_template or "") and MESSAGE in (chat_template or "")

