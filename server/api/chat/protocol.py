"""OpenAI's chat completions bodies (POST /v1/chat/completions) as msgspec structs: the request,
the completion and its chunks. Decoding is strict on the fields we know and ignores the rest
(server/api/openai.py says why); the Messages and Responses routes translate into this request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from kvfork.server.api.openai import Positive, PromptCacheOptions, SamplingFields, TopLogprobs, UsageInfo


class JsonSchemaFormat(Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: str = "text"  # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class ImageUrl(Struct):
    url: str


class ContentPart(Struct):
    """One part of a message's content: text, or an image (server/api/images.py); others are refused
    (unsupported_content). `image_url` is an object as OpenAI sends it, or the URL alone as vLLM accepts."""

    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_cache_options: PromptCacheOptions | None = None  # Responses' cache diagnostics, here too


# ---- the reply -------------------------------------------------------------


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(Struct, omit_defaults=True):
    """`role` and `content` always (content null beside tool calls); the rest when there is some."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    """A call streams as OpenAI's do: index, id, type and name first, then argument chunks."""

    index: int
    function: FunctionDelta
    id: str | None = None
    type: str | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    # only when asked for (server/api/diagnosis.py): Responses' shape, and kvfork's own
    prompt_cache_diagnostics: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    kvfork_cache: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"
    prompt_cache_diagnostics: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET  # on the first chunk
    kvfork_cache: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET  # on the finishing chunk
