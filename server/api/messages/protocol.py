"""Anthropic Messages API shapes (msgspec): requests, replies, stream events, errors.

Known fields are validated strictly; unknown ones (cache_control, citations,
service_tier, container ...) are ignored, as the daemon does for OpenAI's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from kvfork.server.api.openai import CacheSalt

# --- request blocks -------------------------------------------------------------------------------


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class ImageBlock(Struct, tag_field="type", tag="image"):
    source: dict[str, Any] = {}


class DocumentBlock(Struct, tag_field="type", tag="document"):
    source: dict[str, Any] = {}


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(Struct, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(Struct, tag_field="type", tag="redacted_thinking"):
    data: str = ""


RequestBlock = (
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class Message(Struct):
    # "system" in the conversation: Claude Code's mid-conversation-system beta (rendered in place)
    role: Literal["user", "assistant", "system"]
    content: str | list[RequestBlock]


class Tool(Struct):
    """A client tool (`custom`, the default), or one of Anthropic's server tools (web_search_...),
    which have no input_schema and which a local model cannot run."""

    name: Annotated[str, Meta(min_length=1)]
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


class ToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Struct):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(Struct):
    """Structured outputs: the reply is JSON valid against `schema` (output_config.format, or the
    beta's top-level output_format)."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    format: OutputFormat | None = None


class DiagnosticsAsk(Struct):
    """Cache diagnostics (the beta `cache-diagnosis-2026-04-07`, served with or without its header): null on a
    conversation's first turn, then the previous response's id."""

    previous_message_id: str | None = None


class MessagesRequest(Struct, kw_only=True):
    model: str | None = None
    messages: list[Message]
    max_tokens: Annotated[int, Meta(ge=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: Thinking | None = None
    cache_salt: CacheSalt | None = None  # vLLM's, as on chat completions
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    session_id: str | None = None  # kvfork's named session (opt-in; gateways forward the body, not our header)
    diagnostics: DiagnosticsAsk | None = None


class CountTokensRequest(Struct, kw_only=True):
    model: str | None = None
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# --- reply ----------------------------------------------------------------------------------------

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicUsage(Struct):
    input_tokens: int  # prompt tokens not read from the cache, as Anthropic counts them
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class TextOut(Struct, tag_field="type", tag="text"):
    text: str


class ThinkingOut(Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseOut(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class MessageReply(Struct, kw_only=True):
    id: str
    model: str
    content: list[ContentOut]
    usage: AnthropicUsage
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    # only when asked for (server/api/diagnosis.py): Anthropic's, null when nothing diverged; and kvfork's own
    diagnostics: dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    kvfork_cache: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class TokenCount(Struct):
    input_tokens: int


# --- stream events (each goes out as `event: <type>` + `data: <json>`) -----------------------------


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: MessageReply


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentOut


class TextDeltaOut(Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDeltaOut(Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDeltaOut | ThinkingDeltaOut | InputJsonDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct):
    stop_reason: StopReason | None
    stop_sequence: str | None = None


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: AnthropicUsage
    kvfork_cache: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET  # server/api/diagnosis.py


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(Struct, tag_field="type", tag="ping"):
    pass


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop | Ping
)


# --- errors ---------------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class AnthropicErrorDetail(Struct):
    type: str
    message: str


class ErrorReply(Struct, tag_field="type", tag="error"):
    error: AnthropicErrorDetail


def error_reply(status: int, message: str) -> ErrorReply:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return ErrorReply(AnthropicErrorDetail(kind, message))


def error_body(status: int, message: str) -> bytes:
    return msgspec.json.encode(error_reply(status, message))


def sse(event: StreamEvent | ErrorReply) -> bytes:
    tag = type(event).__struct_config__.tag
    return b"event: " + str(tag).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
