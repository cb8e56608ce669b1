"""OpenAI Responses API bodies (POST /v1/responses) as msgspec structs.

As with chat completions, known fields are checked strictly and unknown ones
ignored (Codex and the Agents SDK send `include`, `reasoning`, `prompt_cache_key`
and more). Input items are kept as decoded JSON here and checked one by one in
translate.py, so an error names `input[i]`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct, field

from kvfork.server.api.openai import CacheSalt, Positive, PromptCacheOptions, Temperature, TopP


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(Struct, kw_only=True):
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    cache_salt: CacheSalt | None = None  # vLLM's, as on chat completions
    session_id: str | None = None  # kvfork's named session (opt-in; gateways forward the body, not our header)
    prompt_cache_options: PromptCacheOptions | None = None


# ---- input items ----------------------------------------------------------


class ResponsesContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None
    image_url: str | None = None  # input_image: a data URL, or an http(s) one (server/generate/images.py)


class MessageItem(Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesContentPart]


class FunctionCallItem(Struct, kw_only=True):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None  # a function of a `namespace` tool: its name alone names it here


class FunctionCallOutputItem(Struct, kw_only=True):
    call_id: str
    output: str | list[ResponsesContentPart]


class ReasoningItem(Struct, kw_only=True):
    summary: list[ResponsesContentPart] = field(default_factory=list)
    content: list[ResponsesContentPart] | None = None


# ---- output ---------------------------------------------------------------


class OutputText(Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class ReasoningText(Struct):
    text: str
    type: str = "reasoning_text"


class OutputMessage(Struct, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallOut(Struct, tag_field="type", tag="function_call", omit_defaults=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    namespace: str | None = None  # the `namespace` tool the function came in (omitted for a plain one)


class ReasoningOut(Struct, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    status: str
    summary: list[Any] = field(default_factory=list)


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    text: dict[str, Any]
    parallel_tool_calls: bool
    store: bool
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    object: str = "response"
    # only when asked for (server/api/diagnosis.py): OpenAI's, and kvfork's own once the response ran
    prompt_cache_diagnostics: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET
    kvfork_cache: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class ResponseDeleted(Struct):
    id: str
    object: str = "response"
    deleted: bool = True


# ---- stream events --------------------------------------------------------
# `sequence_number` is set by the stream as it sends each event (reply.py).


class Event(Struct, tag_field="type", kw_only=True):
    sequence_number: int = 0


class ResponseCreated(Event, tag="response.created"):
    response: Response


class ResponseInProgress(Event, tag="response.in_progress"):
    response: Response


class ResponseCompleted(Event, tag="response.completed"):
    response: Response


class ResponseIncomplete(Event, tag="response.incomplete"):
    response: Response


class OutputItemAdded(Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = field(default_factory=list)


class OutputTextDone(Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = field(default_factory=list)


class ReasoningTextDelta(Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDelta(Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str


class ErrorEvent(Event, tag="error"):
    message: str
    code: str | None = None
    param: str | None = None


def sse(event: Event) -> bytes:
    tag = type(event).__struct_config__.tag
    return b"event: " + str(tag).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
