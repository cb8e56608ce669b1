"""MiniMax-M2's calls, read by mlx-lm's minimax_m2 parser:

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

One `invoke` per call (several in one block for parallel calls); values are
text, converted by the tool's schema.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from server.toolcalls.lark import CallGrammar, in_order, parameter_rules
from server.toolcalls.reference import ReferenceParser

_BLOCK = ("<minimax:tool_call>", "</minimax:tool_call>")


class MiniMaxParser(ReferenceParser):
    name = "minimax_m2"
    reference = "minimax_m2"
    markers = (_BLOCK,)
    block, separator = (_BLOCK[0] + "\n", _BLOCK[1]), ""
    special_markers = _BLOCK

    def opening(self, name: str | None) -> str:
        return _BLOCK[0] + "\n<invoke name=" + (json.dumps(name, ensure_ascii=False) + ">" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        parts, rules = parameter_rules(function, index, lambda key: f"\n<parameter name={json.dumps(key)}>",
                                       "</parameter>", specials)
        head = f"<invoke name={json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, in_order(parts), "\n</invoke>\n", rules)
