"""Qwen3-Coder calls: XML with one element per parameter.

    <tool_call>
    <function=write_file>
    <parameter=path>
    a.py
    </parameter>
    </function>
    </tool_call>

The `<tool_call>` wrapper is sometimes left out; a bare `<function=...>` is read
the same way. Values are text; the tool's JSON schema says which to read as
numbers, booleans, objects or arrays (a value that does not fit stays text).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from kvfork.server.toolcalls.base import MarkupToolParser, ParsedCall, json_object
from kvfork.server.toolcalls.grammar_pieces import CallGrammar, in_order, parameter_rules

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _strip_one_newline(value: str) -> str:
    # The format puts each value on its own lines; only those newlines are markup.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def convert(value: str, schema: dict | None) -> Any:
    kind = (schema or {}).get("type", "string")
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type decides
        kind = next((k for k in kind if k != "null"), "string")
    if kind == "string":
        return value
    if value.strip() == "null":
        return None
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind in ("integer", "number", "object", "array"):
        parsed = json_object(value.strip())
        fits = {
            "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            "object": lambda v: isinstance(v, dict),
            "array": lambda v: isinstance(v, list),
        }[kind]
        if fits(parsed):
            return parsed
    return value


class Qwen3CoderParser(MarkupToolParser):
    name = "qwen3_coder"
    markers = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def opening(self, name: str | None) -> str:
        return "<tool_call>\n<function=" + (f"{name}>\n" if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        """`<function=NAME>` then one `<parameter=KEY>` element per property, in the schema's order: required
        ones always, the others optional. String values are free text up to the closing tag; others JSON."""
        parts, rules = parameter_rules(function, index, lambda key: f"<parameter={key}>\n", "\n</parameter>\n",
                                       specials)
        return CallGrammar(f"<tool_call>\n<function={function['name']}>\n", in_order(parts),
                           "</function>\n</tool_call>", rules)

    def parse_call(self, opening: str, body: str) -> list[ParsedCall] | None:
        text = body.strip() if opening == "<tool_call>" else opening + body + "</function>"
        calls, end = [], 0
        for match in _FUNCTION.finditer(text):
            if text[end : match.start()].strip():
                return None  # stray text between functions: not this format
            calls.append(self._call(match.group(1).strip(), match.group(2)))
            end = match.end()
        if not calls or text[end:].strip() or any(c is None for c in calls):
            return None
        return calls  # type: ignore[return-value]

    def _call(self, name: str, body: str) -> ParsedCall | None:
        properties = self.tools.get(name, {}).get("parameters", {}).get("properties", {})
        arguments, end = {}, 0
        for match in _PARAMETER.finditer(body):
            if body[end : match.start()].strip():
                return None
            key = match.group(1).strip()
            arguments[key] = convert(_strip_one_newline(match.group(2)), properties.get(key))
            end = match.end()
        if body[end:].strip() or not name:
            return None
        return ParsedCall(name, arguments)
