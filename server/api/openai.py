"""OpenAI's shapes that more than one route speaks, as msgspec structs: the sampling fields chat
and text completions share, usage, the model list and named sessions' replies. Each API's
own bodies are in its package (server/api/chat/protocol.py, server/api/completions/protocol.py).

Decoding is strict on the fields we know (a string where a number belongs is a
400 naming the field) and ignores the rest: agents send `user`, `metadata`,
`parallel_tool_calls` and more, and refusing them would break those clients.
Fields beyond OpenAI's (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, session_id, chat_template_kwargs, cache_salt) follow vLLM's names.
"""

from __future__ import annotations

from typing import Annotated, Any

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


class PromptCacheOptions(Struct, kw_only=True):
    """OpenAI's Responses `prompt_cache_options`; of it kvfork reads `comparison_response_id` (cache
    diagnostics, server/api/diagnosis.py), on chat completions too. Its presence keeps the request's
    fingerprint for later comparisons."""

    comparison_response_id: str | None = None
    mode: str | None = None  # kvfork caches every prompt: implicit and explicit are the same here
    ttl: str | None = None


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


# ---- replies ---------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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
    phase: str = "ready"  # server/watch/start_progress.py's PHASES: "warming" while --prefix-cache-warm runs
    memory: Any = None  # the engine's memory_plan.MemoryPlan: where the KV budget comes from


class SessionReply(Struct, omit_defaults=True):
    id: str
    object: str  # "session"; no default, so it is never omitted
    reset: bool | None = None
    deleted: bool | None = None


encoder = msgspec.json.Encoder()
