"""OpenAI request and response bodies as msgspec structs.

Decoding is strict on the fields we know (a string where a number belongs is a
400 naming the field) and ignores the rest: agents send `user`, `metadata`,
`parallel_tool_calls` and more, and refusing them would break those clients.
Fields beyond OpenAI's (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, session_id, chat_template_kwargs, cache_salt) follow vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# vLLM's cache_salt: requests reuse only state computed under the same salt (and tenant); see Scope.
CacheSalt = Annotated[str, Meta(min_length=1, max_length=256)]
Positive = Annotated[int, Meta(ge=1)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class StreamOptions(Struct):
    include_usage: bool = False


class JsonSchemaFormat(Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Struct):
    type: str = "text"  # text, json_object or json_schema
    json_schema: JsonSchemaFormat | None = None


class ContentPart(Struct):
    """One part of a message's content; only text parts are served (others: unsupported_content)."""

    type: str
    text: str | None = None


class ChatMessage(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class SamplingFields(Struct, kw_only=True):
    """What chat and text completions share, in OpenAI's spelling."""

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    ignore_eos: bool = False
    n: Positive = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    session_id: str | None = None
    cache_salt: CacheSalt | None = None


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


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, token ids, or a batch of one of either
    logprobs: TopLogprobs | None = None
    echo: bool = False
    best_of: Positive | None = None
    suffix: str | None = None


# ---- responses -------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    object: str = "text_completion"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "kvfork"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class Health(Struct):
    status: str = "ok"


class SessionReply(Struct, omit_defaults=True):
    id: str
    object: str  # "session"; no default, so it is never omitted
    reset: bool | None = None
    deleted: bool | None = None


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(Struct):
    error: ErrorDetail


encoder = msgspec.json.Encoder()
