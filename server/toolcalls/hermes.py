"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Some models put a JSON list of calls in one element; each must be a call.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kvfork.server.toolcalls.base import MarkupToolParser, ParsedCall, call_from_json, json_object
from kvfork.server.toolcalls.grammar_pieces import CallGrammar, json_value, parameters


class HermesParser(MarkupToolParser):
    name = "hermes"
    aliases = ("json_tools",)  # mlx-lm's name for the same markup
    markers = (("<tool_call>", "</tool_call>"),)

    def opening(self, name: str | None) -> str:
        return "<tool_call>\n" + (f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' if name else "")

    @classmethod
    def call_grammar(cls, function: dict[str, Any], index: int, specials: Mapping[str, int]) -> CallGrammar:
        return CallGrammar('<tool_call>\n{"name": ' + json.dumps(function["name"], ensure_ascii=False)
                           + ', "arguments": ', json_value(parameters(function), function), "}\n</tool_call>")

    def parse_call(self, opening: str, body: str) -> list[ParsedCall] | None:
        value = json_object(body.strip())
        calls = [call_from_json(v) for v in (value if isinstance(value, list) else [value])]
        return None if not calls or None in calls else calls  # type: ignore[return-value]


# The fallback for chat templates that render no tools (SmolLM2's, among others):
# the tools are said in a system block in Hermes' words, past calls and their
# results are written into the turns as Hermes markup, and replies are parsed
# as Hermes calls. docs/agents.md quotes the block.
TOOLS_BLOCK = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _call_markup(call: dict) -> str:
    function = call.get("function") or {}
    body = {"name": function.get("name"), "arguments": function.get("arguments")}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def with_tools_block(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Template messages (text content) with the tools in the system turn and calls as markup."""
    block = TOOLS_BLOCK.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "\n".join(_call_markup(c) for c in message["tool_calls"])
            content = f"{message['content']}\n{calls}" if message.get("content") else calls
            message = {k: v for k, v in message.items() if k != "tool_calls"} | {"content": content}
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        out.append(message)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
