"""Kimi K2's and K3's calls, read by mlx-lm's kimi_k2 and kimi_k3 parsers.

K2 writes a section of calls, each named `functions.NAME:N` (N counts the
calls of the conversation), its arguments one JSON object:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

That name is the call's id: K2's template writes `tool_call.id` back, so the
id the client gets (and resends) is the model's own, and the resent call
renders to the tokens the model wrote.

K3 writes XTML elements (`<|open|>tools<|sep|>` ... `<|close|>tools<|sep|>`),
one `call` per call, its arguments typed elements or one JSON block;
constrained calls use the JSON block.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvfork.server.toolcalls.grammar_pieces import CallGrammar, json_value, markup, parameters
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser

_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_CALL, _ARGUMENTS, _END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiK2Parser(MlxLmParser):
    name = "kimi_k2"
    reference = "kimi_k2"
    markers = (_SECTION,)
    block, separator = _SECTION, ""
    special_markers = (*_SECTION, _CALL, _ARGUMENTS, _END)

    def opening(self, name: str | None) -> str:
        return _SECTION[0] + _CALL + (f"functions.{name}:" if name else "functions.")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        body = f"/[0-9]{{1,4}}/ {markup(_ARGUMENTS, specials)} {json_value(parameters(function), function)}"
        return CallGrammar(f"{_CALL}functions.{function['name']}:", body, _END)


_TOOLS = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
XTML = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")  # the vocabulary that says K3


class KimiK3Parser(MlxLmParser):
    name = "kimi_k3"
    reference = "kimi_k3"
    markers = (_TOOLS,)
    block, separator = _TOOLS, ""
    special_markers = XTML

    def opening(self, name: str | None) -> str:
        return _TOOLS[0] + "<|open|>call tool=\"" + (f'{name}" index="1"<|sep|>' if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        head = f'<|open|>call tool="{function["name"]}" index="1"<|sep|><|open|>json type="object"<|sep|>'
        return CallGrammar(head, json_value(parameters(function), function), "<|close|>json<|sep|><|close|>call<|sep|>")
