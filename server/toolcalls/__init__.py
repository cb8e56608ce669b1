"""Tool-call parsers, one module per family, chosen from the model's chat template and vocabulary
unless `--tool-parser` names one.

Each family's module says how it is detected (below, in order), parsed (its parser, most of them
mlx-lm's own: mlx_lm_parsers.py) and constrained (its `call_grammar`, joined by server/generate/grammar.py).
"""

from __future__ import annotations

from typing import Collection

from kvfork.server.toolcalls.base import (
    Event,
    ParsedCall,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
)
from kvfork.server.toolcalls.gemma import FunctionGemmaParser, Gemma4Parser
from kvfork.server.toolcalls.glm import GlmParser, LongcatParser
from kvfork.server.toolcalls.harmony import HarmonyParser, harmony_template
from kvfork.server.toolcalls.hermes import HermesParser
from kvfork.server.toolcalls.kimi import XTML, KimiK2Parser, KimiK3Parser
from kvfork.server.toolcalls.llama3 import Llama3Parser
from kvfork.server.toolcalls.minimax import MiniMaxParser
from kvfork.server.toolcalls.mistral import MistralParser
from kvfork.server.toolcalls.pythonic import PythonicParser
from kvfork.server.toolcalls.qwen3_coder import Qwen3CoderParser
from kvfork.server.toolcalls.xml_calls import MiniCpm5Parser, MuseSparkParser

FAMILIES: tuple[type[ToolParser], ...] = (
    HermesParser, Qwen3CoderParser, Llama3Parser, GlmParser, LongcatParser, KimiK2Parser, KimiK3Parser,
    MiniMaxParser, MistralParser, HarmonyParser, Gemma4Parser, FunctionGemmaParser, PythonicParser,
    MiniCpm5Parser, MuseSparkParser,
)
PARSERS: dict[str, type[ToolParser]] = {
    name: p for p in FAMILIES for name in (p.name, *getattr(p, "aliases", ()))
}
TOOL_PARSER_CHOICES = ("auto", "none", *PARSERS)

# Template markers, most specific first (mlx-lm's order, with Harmony, Kimi K3 and Llama 3 added):
# GLM's templates also say `<tool_call>`, Qwen3-Coder's `<function=`, so the generic `<tool_call>` is last.
_TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<|tool_call>", "<tool_call|>"), "gemma4"),
    (("<start_function_call>",), "function_gemma"),
    (("<longcat_tool_call>",), "longcat"),
    (("<arg_key>",), "glm47"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<|open|>tools<|sep|>",), "kimi_k3"),
    (("<|tool_list_start|>",), "pythonic"),
    (("<|tool_call_start|>",), "pythonic"),
    (("<function=", "<parameter="), "qwen3_coder"),
    (('<function name="', '<param name="'), "minicpm5"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<atem:function_calls>",), "muse_spark"),
    (("<tool_call>",), "hermes"),
    (("<|python_tag|>",), "llama3"),
    (('"parameters": dictionary of argument name',), "llama3"),
)


def detect_tool_parser(chat_template: str | None, vocabulary: Collection[str] = (),
                       named: str | None = None) -> str | None:
    """The format a chat template (or, failing that, the tokenizer's added tokens) teaches its model,
    or None when it teaches none. `named`: the checkpoint's own `tool_parser_type` (mlx-lm's key in
    tokenizer_config.json, which MLX conversions set), first when it is a family kvfork knows."""
    if named in PARSERS:
        return PARSERS[named].name
    template = chat_template or ""
    if harmony_template(template):
        return "harmony"
    for markers, name in _TEMPLATE_MARKERS:
        if all(m in template for m in markers):
            return name
    if all(t in vocabulary for t in XTML):
        return "kimi_k3"
    if "<|tool_call_start|>" in vocabulary and "<|tool_call_end|>" in vocabulary:
        return "pythonic"
    return None


def resolve_tool_parser(setting: str, chat_template: str | None, vocabulary: Collection[str] = (),
                        named: str | None = None) -> str | None:
    """The parser name for a `--tool-parser` value: `auto` reads the template, `none` turns parsing off."""
    if setting == "auto":
        return detect_tool_parser(chat_template, vocabulary, named)
    return None if setting == "none" else PARSERS[setting].name


__all__ = [
    "Event", "ParsedCall", "ReasoningDelta", "TextDelta", "ToolCallArguments", "ToolCallStart", "ToolParser",
    "FAMILIES", "PARSERS", "TOOL_PARSER_CHOICES", "detect_tool_parser", "resolve_tool_parser",
]
