"""Calls as XML elements named by an attribute, one child element per parameter: the shape MiniMax-M2
(minimax.py), MiniCPM5 and Muse Spark share, each read by its mlx-lm parser.

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

from kvfork.server.toolcalls.grammar_pieces import CallGrammar, in_order, parameter_rules
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser


class NamedElementsParser(MlxLmParser):
    """`call_tag` opens with the text before the quoted name and closes the call; `parameter_tag` likewise
    for each parameter; `spacing` goes before each parameter and the call's close, `trail` after it."""

    call_tag = ("", "")
    parameter_tag = ("", "")
    spacing = trail = ""

    def opening(self, name: str | None) -> str:
        return self.block[0] + self.call_tag[0] + (json.dumps(name, ensure_ascii=False) + ">" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        (param_open, param_close), (call_open, call_close) = cls.parameter_tag, cls.call_tag
        parts, rules = parameter_rules(function, index, lambda key: f"{cls.spacing}{param_open}{json.dumps(key)}>",
                                       param_close, specials)
        head = f"{call_open}{json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, in_order(parts), cls.spacing + call_close + cls.trail, rules)


class MiniCpm5Parser(NamedElementsParser):
    name = "minicpm5"
    reference = "minicpm5"
    markers = (("<function name=", "</function>"),)
    separator = ""
    call_tag, parameter_tag = ("<function name=", "</function>"), ("<param name=", "</param>")


_ATEM = ("<atem:function_calls>", "</atem:function_calls>")


class MuseSparkParser(NamedElementsParser):
    name = "muse_spark"
    reference = "muse_spark"
    markers = (_ATEM,)
    block, separator = _ATEM, ""
    call_tag, parameter_tag = ("<atem:invoke name=", "</atem:invoke>"), ("<atem:parameter name=", "</atem:parameter>")
