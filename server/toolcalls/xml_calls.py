"""Calls as XML elements with named parameters, read by mlx-lm's minicpm5 and muse_spark parsers.

MiniCPM5: `<function name="get_weather"><param name="city">Paris</param></function>`,
no wrapper; a text value holding `<`, `&` or a newline may be wrapped in CDATA
(the parser reads both), other values are converted by the tool's schema.
Muse Spark: `<atem:function_calls><atem:invoke name="get_weather"><atem:parameter
name="city">Paris</atem:parameter></atem:invoke></atem:function_calls>`, each
value JSON or, failing that, text.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from server.toolcalls.lark import CallGrammar, in_order, parameter_rules
from server.toolcalls.reference import ReferenceParser


class MiniCpm5Parser(ReferenceParser):
    name = "minicpm5"
    reference = "minicpm5"
    markers = (("<function name=", "</function>"),)
    separator = ""

    def opening(self, name: str | None) -> str:
        return "<function name=" + (json.dumps(name, ensure_ascii=False) + ">" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        parts, rules = parameter_rules(function, index, lambda key: f"<param name={json.dumps(key)}>", "</param>",
                                       specials)
        head = f"<function name={json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, in_order(parts), "</function>", rules)


_ATEM = ("<atem:function_calls>", "</atem:function_calls>")


class MuseSparkParser(ReferenceParser):
    name = "muse_spark"
    reference = "muse_spark"
    markers = (_ATEM,)
    block, separator = _ATEM, ""

    def opening(self, name: str | None) -> str:
        return _ATEM[0] + "<atem:invoke name=" + (json.dumps(name, ensure_ascii=False) + ">" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        parts, rules = parameter_rules(function, index, lambda key: f"<atem:parameter name={json.dumps(key)}>",
                                       "</atem:parameter>", specials)
        head = f"<atem:invoke name={json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, in_order(parts), "</atem:invoke>", rules)
