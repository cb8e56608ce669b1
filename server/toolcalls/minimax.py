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

from server.toolcalls.lark import CallGrammar, is_text, json_value, markup, properties, text_until
from server.toolcalls.reference import ReferenceParser

_BLOCK = ("<minimax:tool_call>", "</minimax:tool_call>")


class MiniMaxParser(ReferenceParser):
    name = "minimax_m2"
    reference = "minimax_m2"
    markers = (_BLOCK,)
    special_markers = _BLOCK

    def opening(self, name: str | None) -> str:
        return _BLOCK[0] + "\n<invoke name=" + (json.dumps(name, ensure_ascii=False) + ">" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        rules, parts = [], []
        for k, (key, schema, required) in enumerate(properties(function)):
            rule, head = f"p{index}_{k}", markup(f"\n<parameter name={json.dumps(key)}>", specials)
            if is_text(schema):
                rules += [text_until(f"{rule}_value", "</parameter>", specials), f"{rule}: {head} {rule}_value"]
            else:
                rules.append(f"{rule}: {head} {json_value(schema, function)} {markup('</parameter>', specials)}")
            parts.append(rule if required else f"{rule}?")
        head = f"{_BLOCK[0]}\n<invoke name={json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, " ".join(parts), "\n</invoke>\n" + _BLOCK[1], rules)
