"""A Responses request, said as the OpenAI chat request it means (as api/messages does for Anthropic's).

The mapping keeps one rule for rendering, `prepare`'s, so a history sent
through /v1/responses renders to the same prompt tokens as its chat twin:
- `instructions` → the first system message; a `developer` message → system.
- message items → messages; text parts stay parts (`prepare` joins them), `input_image`
  parts become chat's `image_url` parts, in a `function_call_output` too
  (server/api/images.py decides what a model takes).
- `function_call` items → the `tool_calls` of the assistant message just before
  them (or of a new one); `function_call_output` → `tool` messages.
- `reasoning` items → `reasoning_content` of the next assistant message (of an
  empty one when nothing follows them).
- function tools → chat's `{"type": "function", "function": {...}}` in OpenAI's
  key order, the functions of a `namespace` tool flattened among them (a call to
  one is answered with its `namespace`); other tool types (web search, local
  shell ...) are dropped and named in the log and the X-Kvfork-Dropped-Tools
  header: nothing here runs them, and refusing them would stop the agent.
- `text.format` → `response_format`; `max_output_tokens` → `max_tokens`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvfork.server.guard.errors import ApiError, client_text, from_decode, invalid
from kvfork.server.api.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesContentPart,
    ResponsesRequest,
)

TEXT_PARTS = ("input_text", "output_text", "text")


def _convert(raw: dict, kind: type, where: str):
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as e:
        error = from_decode(e)
        raise invalid(f"{where}.{error.param}" if error.param else where, f"{where}: {error.message}") from None


def _parts(parts: list[ResponsesContentPart], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if part.type == "input_image" and part.image_url is not None:
            out.append({"type": "image_url", "image_url": {"url": part.image_url}})
        elif part.type == "input_image":
            raise ApiError(400, "an input_image is sent by its image_url (a data URL); kvfork serves no Files API",
                           code="unsupported_content", param=f"{where}.content[{j}]")
        elif part.type in TEXT_PARTS:
            out.append({"type": "text", "text": part.text or ""})
        else:
            raise ApiError(400, f"content parts of type {client_text(part.type, 32)} are not supported; send text "
                           "or input_image", code="unsupported_content", param=f"{where}.content[{j}]")
    return out


def chat_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages (without the instructions)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # waits for the assistant message it belongs to

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        out.append(message)
        return message

    for i, raw in enumerate(items):
        where = f"input[{i}]"
        kind = raw.get("type", "message") if isinstance(raw, dict) else None
        if kind == "message":
            item = _convert(raw, MessageItem, where)
            content = item.content if isinstance(item.content, str) else _parts(item.content, where)
            message = {"role": item.role, "content": content}
            if item.role == "assistant":
                assistant(message)
            else:
                out.append(message)
        elif kind == "function_call":
            call = _convert(raw, FunctionCallItem, where)
            tool_call = {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(tool_call)
            else:
                assistant({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            result = _convert(raw, FunctionCallOutputItem, where)
            output = result.output if isinstance(result.output, str) else _parts(result.output, where)
            out.append({"role": "tool", "tool_call_id": result.call_id, "content": output})
        elif kind == "reasoning":
            item = _convert(raw, ReasoningItem, where)
            reasoning += [part.text or "" for part in item.content or item.summary]
        else:
            raise invalid(f"{where}.type", f"{where}: input items are messages, function_call, "
                          f"function_call_output or reasoning, got {kind!r}")
    if reasoning:  # reasoning the turn ended on (a reply cut short while it thought)
        assistant({"role": "assistant", "content": ""})
    return out


def tool_functions(tools: list[dict[str, Any]] | None) -> tuple[list[tuple[str | None, dict[str, Any]]], list[str]]:
    """The function tools a request offers, as (namespace, tool) with the functions of a `namespace`
    tool (Codex groups its multi-agent tools so) flattened in place, and the tools dropped: the other
    kinds (web_search, local_shell, custom ...), which nothing here runs, and a function whose name
    an earlier one took (a template cannot tell two functions of one name apart)."""
    out: list[tuple[str | None, dict[str, Any]]] = []
    dropped: list[str] = []
    names: set[str] = set()

    def add(namespace: str | None, tool: Any, where: str) -> None:
        if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
            raise invalid(f"{where}.type", 'a tool is an object with a string type, e.g. {"type": "function", ...}')
        if tool["type"] != "function":
            dropped.append(tool["type"])
            return
        if not isinstance(tool.get("name"), str):
            raise invalid(f"{where}.name", 'a function tool is {"type": "function", "name": ..., "parameters": ...}')
        if tool["name"] in names:
            dropped.append(f"{namespace}.{tool['name']}" if namespace else tool["name"])
            return
        names.add(tool["name"])
        out.append((namespace, tool))

    for i, tool in enumerate(tools or ()):
        if tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            if not isinstance(tool.get("tools") or [], list):
                raise invalid(f"tools[{i}].tools", "a namespace tool's tools are a list")
            for j, inner in enumerate(tool.get("tools") or ()):
                add(tool["name"], inner, f"tools[{i}].tools[{j}]")
        else:
            add(None, tool, f"tools[{i}]")
    return out, dropped


def tool_count(tools: list[dict[str, Any]] | None) -> int:
    """How many tools a request offers, each function of a `namespace` tool counted (--max-tools)."""
    total = 0
    for tool in tools or ():
        inner = tool.get("tools") if tool.get("type") == "namespace" else None
        total += len(inner) if isinstance(inner, list) else 1
    return total


def namespaces(tools: list[dict[str, Any]] | None) -> dict[str, str]:
    """Each flattened function's namespace, by its name: what a call to it is answered with."""
    return {tool["name"]: namespace for namespace, tool in tool_functions(tools)[0] if namespace is not None}


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for _, tool in tool_functions(tools)[0]:
        function: dict[str, Any] = {"name": tool["name"]}  # templates `tojson` tools: OpenAI's key order
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: `prepare` checks it
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", 'tool_choice is "auto", "none", "required" or {"type": "function", "name": ...}')


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    form = body.text.format if body.text else None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return {"type": "json_object"}
    if not form.name:
        raise invalid("text.format.name", "a json_schema format needs a name")
    if form.schema is None:
        raise invalid("text.format.schema", "a json_schema format needs a schema")
    schema: dict[str, Any] = {"name": form.name, "schema": form.schema, "strict": bool(form.strict)}
    if form.description is not None:
        schema["description"] = form.description
    return {"type": "json_schema", "json_schema": schema}


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]], session: str | None) -> dict[str, Any]:
    """The chat-completions body (as decoded JSON): instructions, then `history` (chat messages)."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) + history
    if not messages:
        raise invalid("input", "the input holds no items")
    chat: dict[str, Any] = {"messages": messages}
    optional = {"model": body.model, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
                "top_p": body.top_p, "session_id": session if session is not None else body.session_id,
                "response_format": _response_format(body),
                "cache_salt": body.cache_salt}
    chat.update({k: v for k, v in optional.items() if v is not None})
    tools = _tools(body.tools)
    if tools:
        chat["tools"] = tools
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    return chat
