"""Tool-call parsers, chosen from the model's chat template unless `--tool-parser` names one."""

from __future__ import annotations

from kvfork.server.toolcalls.base import (
    Event,
    ParsedCall,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
)
from kvfork.server.toolcalls.hermes import HermesParser
from kvfork.server.toolcalls.llama3 import Llama3Parser
from kvfork.server.toolcalls.qwen3_coder import Qwen3CoderParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Qwen3CoderParser, Llama3Parser)}
TOOL_PARSER_CHOICES = ("auto", "none", *PARSERS)


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches its model, or None when it teaches none.

    The most specific markup wins: Qwen3-Coder templates also mention `<tool_call>`.
    """
    template = chat_template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return "llama3"
    return None


def resolve_tool_parser(setting: str, chat_template: str | None) -> str | None:
    """The parser name for a `--tool-parser` value: `auto` reads the template, `none` turns parsing off."""
    if setting == "auto":
        return detect_tool_parser(chat_template)
    return None if setting == "none" else setting


__all__ = [
    "Event", "ParsedCall", "ReasoningDelta", "TextDelta", "ToolCallArguments", "ToolCallStart", "ToolParser",
    "PARSERS", "TOOL_PARSER_CHOICES", "detect_tool_parser", "resolve_tool_parser",
]
