"""OpenAI's text completions bodies (POST /v1/completions) as msgspec structs."""

from __future__ import annotations

from msgspec import Struct

from kvfork.server.api.openai import Positive, SamplingFields, TopLogprobs, UsageInfo


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[str | int | list[int]]  # text, token ids, or a batch of one of either
    logprobs: TopLogprobs | None = None
    echo: bool = False
    best_of: Positive | None = None
    suffix: str | None = None


# ---- the reply -------------------------------------------------------------


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
