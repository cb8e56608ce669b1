"""Calls as XML elements with named parameters, read by mlx-lm's minicpm5 and muse_spark parsers.

MiniCPM5: `<function name="get_weather"><param name="city">Paris</param></function>`,
no wrapper; a text value holding `<`, `&` or a newline is wrapped in CDATA
(constrained calls always wrap text values), other values are converted by the
tool's schema.
Muse Spark: `<atem:function_calls><atem:invoke name="get_weather"><atem:parameter
name="city">"Paris"</atem:parameter></atem:invoke></atem:function_calls>`, each
value JSON (bare text is read as text).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from server.toolcalls.lark import CallGrammar, is_text, json_value, markup, properties, text_until
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
        rules, parts = [], []
        for k, (key, schema, required) in enumerate(properties(function)):
            rule, head = f"p{index}_{k}", markup(f"<param name={json.dumps(key)}>", specials)
            if is_text(schema):
                rules += [text_until(f"{rule}_value", "]]></param>", specials),
                          f'{rule}: {head} "<![CDATA[" {rule}_value']
            else:
                rules.append(f'{rule}: {head} {json_value(schema, function)} "</param>"')
            parts.append(rule if required else f"{rule}?")
        head = f"<function name={json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, " ".join(parts), "</function>", rules)


_ATEM = ("<atem:function_calls>", "</atem:function_calls>")


class MuseSparkParser(ReferenceParser):
    name = "muse_spark"
    reference = "muse_spark"
    markers = (_ATEM,)
    separator = ""

    def opening(self, name: str | None) -> str:
        return _ATEM[0] + "<atem:invoke name=" + (json.dumps(name, ensure_ascii=False) + ">" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        rules, parts = [], []
        for k, (key, schema, required) in enumerate(properties(function)):
            rule = f"p{index}_{k}"
            rules.append(f"{rule}: {markup(f'<atem:parameter name={json.dumps(key)}>', specials)} "
                         f'{json_value(schema, function)} "</atem:parameter>"')
            parts.append(rule if required else f"{rule}?")
        head = f"{_ATEM[0]}<atem:invoke name={json.dumps(function['name'], ensure_ascii=False)}>"
        return CallGrammar(head, " ".join(parts), "</atem:invoke>" + _ATEM[1], rules)
