"""An Anthropic Messages request, said as the OpenAI chat request it means.

The daemon feeds chat templates from OpenAI chat requests, so a Messages request
is translated into one and then takes exactly that path: an agent history sent
through either API renders to the same prompt tokens and gets the same reuse.

The mapping keeps structure rather than flattening it, so one rule (the chat
route's) decides how text parts join:
- `system` as a string stays a string; as blocks it becomes text parts.
- A user message's `tool_result` blocks become `tool` messages, in order; runs
  of text and image blocks between them become user messages with text and
  `image_url` parts (a base64 source as a data URL), and so does a tool
  result's content (server/api/images.py decides what a model takes).
- An assistant message's text blocks become its content parts, `tool_use`
  blocks its `tool_calls` (arguments rendered as the templates' `tojson` does),
  `thinking` blocks its `reasoning_content`.
- client tools become functions keyed in OpenAI's order (templates `tojson`
  them); Anthropic's server tools (web search ...) are dropped: nothing here
  can run them, and refusing the request would stop the agent.
- a `system` message in the conversation (Claude Code's mid-conversation-system
  beta) stays a system message where it stands; a template that refuses one there
  gets it merged into the adjacent user turn (prepare.inline_system_messages).
- structured outputs (`output_config.format`, the beta's `output_format`) →
  `response_format` json_schema.
- tool_choice: auto → auto, any → required, tool → the named function, none → none.
- thinking enabled/adaptive/disabled → chat_template_kwargs.enable_thinking.
"""

from __future__ import annotations

from typing import Any

from kvfork.server.api.messages.protocol import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from kvfork.server.toolcalls.base import arguments_json


class UnsupportedContent(ValueError):
    """A block kvfork cannot feed the model: documents, images anywhere but user turns and tool results."""


def _parts(blocks: list[TextBlock]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": b.text} for b in blocks]


def _check_text(block: object, where: str) -> None:
    if isinstance(block, (ImageBlock, DocumentBlock)):
        raise UnsupportedContent(f"{where}: {type(block).__struct_config__.tag} content is not supported")


def _image(block: ImageBlock, where: str) -> dict[str, Any]:
    """An image block as chat's image_url part: a base64 source as a data URL, a url source as its URL."""
    source = block.source
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    elif kind in ("base64", "url"):
        raise ValueError(f"{where}: an image's {kind} source needs " +
                         ("media_type and data" if kind == "base64" else "a url"))
    else:
        raise UnsupportedContent(f"{where}: an image source is base64 or url (kvfork serves no Files API)")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_parts(blocks: list, where: str) -> list[dict[str, Any]]:
    """Text and image blocks (of a user turn, or a tool result's content) as chat's content parts."""
    out = []
    for block in blocks:
        if isinstance(block, ImageBlock):
            out.append(_image(block, where))
        else:
            _check_text(block, where)
            out.append({"type": "text", "text": block.text})
    return out


def _user(content: str | list, index: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    where = f"messages[{index}]"
    parts: list[TextBlock | ImageBlock] = []
    for block in content:
        if isinstance(block, (TextBlock, ImageBlock)):
            parts.append(block)
            continue
        _check_text(block, where)
        if parts:
            out.append({"role": "user", "content": _user_parts(parts, where)})
            parts = []
        if isinstance(block, ToolResultBlock):
            result = block.content
            if not isinstance(result, str):
                result = _user_parts(result, f"{where} tool_result")  # type: ignore[assignment]
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
        elif not isinstance(block, (ThinkingBlock, RedactedThinkingBlock)):
            kind = type(block).__struct_config__.tag
            raise ValueError(f"messages[{index}]: {kind} blocks belong to assistant messages")
    if parts or not out:
        out.append({"role": "user", "content": _user_parts(parts, where)})
    return out


def _assistant(content: str | list, index: int) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls, thoughts = [], [], []
    for block in content:
        _check_text(block, f"messages[{index}]")
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": arguments_json(block.input)}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolResultBlock):
            raise ValueError(f"messages[{index}]: tool_result blocks belong to user messages")
    message: dict[str, Any] = {"role": "assistant", "content": _parts(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return message


def _system(content: str | list, index: int) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "system", "content": content}
    for block in content:
        if not isinstance(block, TextBlock):
            kind = type(block).__struct_config__.tag
            raise ValueError(f"messages[{index}]: a system message holds text blocks, not {kind}")
    return {"role": "system", "content": _parts(content)}


def dropped_tools(request: MessagesRequest | CountTokensRequest) -> list[str]:
    """Anthropic's server tools (web_search_..., code_execution_...): nothing here runs them."""
    return [t.type or t.name for t in request.tools or () if t.type not in (None, "custom")]


def _tool(index: int, tool: Tool) -> dict[str, Any]:
    if tool.input_schema is None:
        raise ValueError(f"tools[{index}]: a custom tool needs an input_schema")
    # Key order matters: templates render tools with `tojson`, which keeps it.
    # This is the order OpenAI's documentation and clients use.
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.input_schema
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        if not choice.name:
            raise ValueError("tool_choice: type 'tool' needs a name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def items_over(request: MessagesRequest | CountTokensRequest, limit: int) -> int | None:
    """The messages and content blocks (a tool result's own blocks too, the system's) a request holds, when
    more than `limit`; None otherwise. Each is work on the loop when translated, so they are counted first,
    and the count stops past the limit."""
    count = len(request.system) if isinstance(request.system, list) else 0
    for message in request.messages:
        count += 1
        if isinstance(message.content, list):
            count += len(message.content)
            if count > limit:
                return count
            for block in message.content:
                if isinstance(block, ToolResultBlock) and isinstance(block.content, list):
                    count += len(block.content)
        if count > limit:
            return count
    return None


def chat_request(request: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The OpenAI chat-completions request body (as decoded JSON) this Messages request means."""
    messages: list[dict[str, Any]] = []
    if isinstance(request.system, str):
        messages.append({"role": "system", "content": request.system})
    elif request.system:
        messages.append({"role": "system", "content": _parts(request.system)})
    for index, message in enumerate(request.messages):
        if message.role == "user":
            messages += _user(message.content, index)
        elif message.role == "system":
            messages.append(_system(message.content, index))
        else:
            messages.append(_assistant(message.content, index))
    body: dict[str, Any] = {"messages": messages}
    if request.model is not None:
        body["model"] = request.model
    tools = [_tool(i, t) for i, t in enumerate(request.tools or ()) if t.type in (None, "custom")]
    if tools:
        body["tools"] = tools
    if request.tool_choice:
        body["tool_choice"] = _tool_choice(request.tool_choice)
        if request.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if request.thinking:
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
    if isinstance(request, MessagesRequest):
        body["max_tokens"] = request.max_tokens
        optional = {"stop": request.stop_sequences, "temperature": request.temperature,
                    "top_p": request.top_p, "top_k": request.top_k, "cache_salt": request.cache_salt,
                    "session_id": request.session_id}
        body.update({k: v for k, v in optional.items() if v is not None})
        form = request.output_config.format if request.output_config else None
        form = form or request.output_format
        if form is not None:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": form.schema, "strict": True}}
    return body
