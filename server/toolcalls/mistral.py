"""Mistral's calls (Devstral, Mistral Small 3.2, Magistral), read by mlx-lm's mistral parser:

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

(earlier models: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]`). Nothing
closes a call: the calls run to the end of the reply, so once `[TOOL_CALLS]`
is written the rest is held until the reply ends, then parsed.
"""

from __future__ import annotations

from typing import Any, Mapping

from kvfork.server.toolcalls.grammar_pieces import CallGrammar, json_value, parameters
from kvfork.server.toolcalls.mlx_lm_parsers import MlxLmParser

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralParser(MlxLmParser):
    name = "mistral"
    reference = "mistral"
    markers = ((TOOL_CALLS, ""),)
    separator = ""
    special_markers = (TOOL_CALLS, ARGS, "[CALL_ID]")

    def opening(self, name: str | None) -> str:
        return TOOL_CALLS + (name + ARGS if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        return CallGrammar(TOOL_CALLS + function["name"] + ARGS, json_value(parameters(function), function), "")
