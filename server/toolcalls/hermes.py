"""Hermes / Qwen2.5 / Qwen3 calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Some models put a JSON list of calls in one element; each must be a call.
"""

from __future__ import annotations

import json

from server.toolcalls.base import MarkupToolParser, ParsedCall, call_from_json, json_object


class HermesParser(MarkupToolParser):
    name = "hermes"
    markers = (("<tool_call>", "</tool_call>"),)

    def opening(self, name: str | None) -> str:
        return "<tool_call>\n" + (f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ' if name else "")

    def parse_call(self, opening: str, body: str) -> list[ParsedCall] | None:
        value = json_object(body.strip())
        calls = [call_from_json(v) for v in (value if isinstance(value, list) else [value])]
        return None if not calls or None in calls else calls  # type: ignore[return-value]
