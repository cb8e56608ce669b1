"""Pythonic calls (LFM2, Llama 4's and others' templates), read by mlx-lm's pythonic parser:

    <|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>

Keyword arguments; values are Python literals (the parser also reads JSON's
true/false/null). Constrained calls write each value as JSON.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvfork.server.toolcalls.grammar_pieces import CallGrammar, joined, json_value, properties
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser

_BLOCK = ("<|tool_call_start|>", "<|tool_call_end|>")


class PythonicParser(MlxLmParser):
    name = "pythonic"
    reference = "pythonic"
    markers = (_BLOCK,)
    block, separator = (_BLOCK[0] + "[", "]" + _BLOCK[1]), ", "  # [a(x=1), b(y=2)]
    special_markers = _BLOCK

    def opening(self, name: str | None) -> str:
        return _BLOCK[0] + "[" + (name + "(" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        rules, required, optional = [], [], []
        for k, (key, schema, is_required) in enumerate(properties(function)):
            rule = f"p{index}_{k}"
            rules.append(f'{rule}: "{key}=" {json_value(schema, function)}')
            (required if is_required else optional).append(rule)
        body = joined(required, optional, ", ")
        return CallGrammar(f"{function['name']}(", body, ")", rules)
