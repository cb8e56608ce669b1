"""Gemma's calls, read by mlx-lm's gemma4 and function_gemma parsers.

Gemma 4: `<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>`:
bare keys, strings between `<|"|>` tokens, other values as JSON.
FunctionGemma: `<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>`.
Constrained calls write the properties in the schema's order, the required
ones first.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvfork.server.toolcalls.grammar_pieces import CallGrammar, joined, parameter_rules
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser


def _arguments(function: dict[str, Any], index: int, quote: str, specials: Mapping[str, int]) -> tuple[str, list[str]]:
    """`key:value` pairs joined by commas: required ones always, optional ones after them."""
    parts, rules = parameter_rules(function, index, lambda key: key + ":", "", specials, text=(quote, quote))
    required, optional = [r for r, needed in parts if needed], [r for r, needed in parts if not needed]
    return joined(required, optional, ","), rules


class Gemma4Parser(MlxLmParser):
    name = "gemma4"
    reference = "gemma4"
    quote = '<|"|>'
    markers = (("<|tool_call>", "<tool_call|>"),)
    special_markers = ("<|tool_call>", "<tool_call|>", '<|"|>')

    def opening(self, name: str | None) -> str:
        return self.markers[0][0] + "call:" + (name + "{" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        body, rules = _arguments(function, index, cls.quote, specials)
        return CallGrammar(f"{cls.markers[0][0]}call:{function['name']}{{", body, "}" + cls.markers[0][1], rules)


class FunctionGemmaParser(Gemma4Parser):
    name = "function_gemma"
    reference = "function_gemma"
    quote = "<escape>"
    markers = (("<start_function_call>", "<end_function_call>"),)
    special_markers = ("<start_function_call>", "<end_function_call>", "<escape>")
