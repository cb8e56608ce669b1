"""Tools in chat completions: checking tools and tool_choice, feeding calls back to
templates, and saying parsed output in OpenAI's message and delta shapes."""

from __future__ import annotations

import json
from typing import Any

from server.chat_output import ChatOutput
from server.errors import invalid
from server.protocol.openai import AssistantMessage, Delta, FunctionCall, FunctionDelta, ToolCallDelta, ToolCallOut
from server.toolcalls.base import Event, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart


def check_tools(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names offered; 400 naming the tool that is not a function with a name."""
    names = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if tool.get("type") != "function" or not named:
            raise invalid(f"tools[{i}]", 'a tool is {"type": "function", "function": {"name": ..., "parameters": ...}}')
        names.append(function["name"])
    return names


def tool_choice_of(choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    """(auto | none | required | function, the named function)."""
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"tool_choice is auto, none, required or a function, got {choice!r}")
        if choice == "required" and not names:
            raise invalid("tool_choice", "tool_choice 'required' needs tools")
        return choice, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise invalid("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
    return "function", name


def template_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as templates read them: JSON-object arguments as objects.

    OpenAI clients send arguments as JSON text, but many templates render them
    with `tojson` (Llama 3, Qwen2.5): text would come out quoted twice.
    """
    out = []
    for call in calls:
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except ValueError:
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


def assistant_message(output: ChatOutput) -> AssistantMessage:
    calls = [ToolCallOut(c.id, FunctionCall(c.name, c.arguments)) for c in output.tool_calls]
    content = output.content if output.content or not calls else None
    return AssistantMessage("assistant", content, reasoning_content=output.reasoning or None, tool_calls=calls or None)


def finish_reason(reason: str, has_calls: bool) -> str:
    return "tool_calls" if has_calls and reason == "stop" else reason


def deltas(events: list[Event]) -> list[Delta]:
    out = []
    for event in events:
        if isinstance(event, TextDelta):
            out.append(Delta(content=event.text))
        elif isinstance(event, ReasoningDelta):
            out.append(Delta(reasoning_content=event.text))
        elif isinstance(event, ToolCallStart):
            start = ToolCallDelta(event.index, FunctionDelta(event.name, ""), id=event.id, type="function")
            out.append(Delta(tool_calls=[start]))
        elif isinstance(event, ToolCallArguments):
            out.append(Delta(tool_calls=[ToolCallDelta(event.index, FunctionDelta(arguments=event.text))]))
    return out
