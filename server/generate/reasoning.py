"""Splits reasoning from content, streaming, for each family's thinking markers.

Most families write `<think>…</think>` (Qwen3, GLM, Kimi K2, MiniMax-M2,
DeepSeek-R1); Magistral writes `[THINK]…[/THINK]`, Gemma 4
`<|channel>thought…<channel|>`, LongCat `<longcat_think>…</longcat_think>`,
Kimi K3 `<|open|>think<|sep|>…<|close|>think<|sep|>`. gpt-oss's Harmony
channels are read by its own parser (toolcalls/harmony.py). `auto` picks the
format whose opening marker the chat template uses.

Templates that open the block in the generation prompt (QwQ, DeepSeek-R1, some
Qwen3 variants) leave the reply starting inside it, with only the closing
marker in the output: `starts_in_reasoning(prompt_text, fmt)` tells the
splitter so.

The newlines a model puts just inside the markers and just after the closing
one are markup, not text: they are dropped, so reasoning and content come out clean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from kvfork.server.toolcalls.base import Event, ReasoningDelta, TextDelta, held_prefix
from kvfork.server.toolcalls.harmony import harmony_template
from kvfork.server.toolcalls.kimi import XTML


@dataclass(frozen=True)
class ThinkingFormat:
    name: str
    open: str
    close: str
    vocabulary: tuple[str, ...] = ()  # added tokens that say this format when the template does not


# In the order `auto` tries them: the specific markers before `<think>`, which other templates may mention.
FORMATS = {f.name: f for f in (
    ThinkingFormat("gemma4", "<|channel>thought", "<channel|>", ("<|channel>", "<channel|>")),
    ThinkingFormat("kimi_k3", "<|open|>think<|sep|>", "<|close|>think<|sep|>", XTML),
    ThinkingFormat("mistral", "[THINK]", "[/THINK]"),
    ThinkingFormat("longcat", "<longcat_think>", "</longcat_think>"),
    ThinkingFormat("think_start", "<|think:start|>", "<|think:end|>"),
    ThinkingFormat("think", "<think>", "</think>"),
)}
REASONING_CHOICES = ("auto", "none", *FORMATS, "harmony")
THINK = FORMATS["think"]


def detect_reasoning(chat_template: str | None, vocabulary: Collection[str] = ()) -> str | None:
    """The thinking format a chat template uses (harmony for gpt-oss's channels), or None."""
    template = chat_template or ""
    if harmony_template(template):
        return "harmony"
    for fmt in FORMATS.values():
        if fmt.open in template or (fmt.vocabulary and all(t in vocabulary for t in fmt.vocabulary)):
            return fmt.name
    return None


def resolve_reasoning(setting: str, chat_template: str | None, vocabulary: Collection[str] = ()) -> str | None:
    """The format a `--reasoning-parser` value means: `auto` reads the template, `none` turns the split off."""
    if setting == "auto":
        return detect_reasoning(chat_template, vocabulary)
    return None if setting == "none" else setting


def starts_in_reasoning(prompt_text: str, fmt: ThinkingFormat = THINK) -> bool:
    return prompt_text.rstrip().endswith(fmt.open)


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False, fmt: ThinkingFormat = THINK):
        self.fmt = fmt
        self._in_reasoning = in_reasoning
        self._strip_lead = in_reasoning  # drop whitespace just after a marker
        self._buffer = ""
        self._held_ws = ""  # trailing whitespace of reasoning: dropped if the block closes next

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while (at := self._buffer.find(marker := self.fmt.close if self._in_reasoning else self.fmt.open)) >= 0:
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
