"""Splits `<think>…</think>` reasoning from content, streaming.

Templates that open `<think>` in the generation prompt (QwQ, DeepSeek-R1, some
Qwen3 variants) leave the reply starting inside the block, with only the closing
tag in the output: `starts_in_reasoning(prompt_text)` tells the splitter so.

The newlines a model puts just inside the tags and just after `</think>` are
markup, not text: they are dropped, so reasoning and content come out clean.
"""

from __future__ import annotations

from kvfork.server.toolcalls.base import Event, ReasoningDelta, TextDelta, held_prefix

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(chat_template: str | None) -> bool:
    return OPEN in (chat_template or "")


def starts_in_reasoning(prompt_text: str) -> bool:
    return prompt_text.rstrip().endswith(OPEN)


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False):
        self._in_reasoning = in_reasoning
        self._strip_lead = in_reasoning  # drop whitespace just after a tag
        self._buffer = ""
        self._held_ws = ""  # trailing whitespace of reasoning: dropped if the block closes next

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while (at := self._buffer.find(marker := CLOSE if self._in_reasoning else OPEN)) >= 0:
            self._emit(self._buffer[:at], out)
            self._buffer = self._buffer[at + len(marker) :]
            self._in_reasoning, self._strip_lead, self._held_ws = not self._in_reasoning, True, ""
        keep = held_prefix(self._buffer, marker)
        self._emit(self._buffer[: len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._emit(self._buffer, out)
        self._buffer = ""
        return out

    def _emit(self, text: str, out: list[Event]) -> None:
        if self._strip_lead:
            text = text.lstrip()
            if not text:
                return
            self._strip_lead = False
        if not self._in_reasoning:
            if text:
                out.append(TextDelta(text))
            return
        core = text.rstrip()
        if not core:
            self._held_ws += text
            return
        out.append(ReasoningDelta(self._held_ws + core))
        self._held_ws = text[len(core) :]
