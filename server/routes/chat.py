"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from server.engine.api import TokenEvent
from server.errors import ApiError, invalid, unsupported
from server.generation import Finished, KeepAlive, Piece, generation
from server.protocol.openai import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
    ChoiceLogprobs, ChunkChoice, Delta, TokenLogprob, TopLogprob,
)
from server.routes.common import decoder, json_response, read_body, usage_info
from server.sampling import check_supported, generate_request, request_id, session_id, stop_strings
from server.sse import EventStream
from server.state import AppState, state_of
from server.text.tokenizer import PromptTokenizer

DECODE = decoder(ChatCompletionRequest)


def template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: text content, the other fields passed through."""
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text":
                raise ApiError(400, f"content parts of type {part.type!r} are not supported; send text",
                               code="unsupported_content", param=f"messages[{index}].content[{j}]")
        content = "\n".join(part.text or "" for part in content)
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content or ""}
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    return out


def token_logprobs(events: list[TokenEvent], tokenizer: PromptTokenizer) -> list[TokenLogprob]:
    def entry(token: int, logprob: float) -> TopLogprob:
        text = tokenizer.token_text(token)
        return TopLogprob(text, logprob, list(text.encode()))

    out = []
    for event in events:
        if event.logprob is None:
            continue
        top = [entry(t, lp) for t, lp in event.top_logprobs or ()]
        head = entry(event.token, event.logprob)
        out.append(TokenLogprob(head.token, head.logprob, head.bytes, top))
    return out


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body: ChatCompletionRequest = await read_body(request, DECODE)
    check_supported(body)
    if body.response_format is not None and body.response_format.type != "text":
        raise unsupported("response_format", f"response_format {body.response_format.type!r} is not supported yet")
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    model = state.model_name(body.model)
    session = session_id(body.session_id, request.headers.get("X-Session-ID"))
    messages = [template_message(i, m) for i, m in enumerate(body.messages)]
    tokenizer = state.require_ready()
    prompt = await tokenizer.chat(messages, body.tools, body.chat_template_kwargs)
    rid = request_id("chatcmpl")
    generate = generate_request(
        body, prompt, rid=rid, vocab_size=state.engine.info.vocab_size,
        max_tokens=body.max_completion_tokens or body.max_tokens, session=session,
        logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
    )
    reply = _Reply(rid, int(time.time()), model, body.logprobs, tokenizer)
    if body.stream:
        return await _stream(request, state, body, generate, reply)
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async with generation(state.engine, generate, tokenizer, stop_strings(body)) as events:
        async for event in events:
            if isinstance(event, Piece):
                parts.append(event.text)
                logprobs += reply.logprobs_of(event)
            elif isinstance(event, Finished):
                choice = ChatChoice(0, AssistantMessage("".join(parts)), event.finish_reason,
                                    ChoiceLogprobs(logprobs) if body.logprobs else None)
                completion = ChatCompletion(rid, reply.created, model, [choice], usage_info(event.usage))
                return json_response(completion)
    raise ApiError(503, "the engine ended the request without a result", code="engine_error")


async def _stream(request: web.Request, state: AppState, body: ChatCompletionRequest, generate, reply: "_Reply"):
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    async with (generation(state.engine, generate, reply.tokenizer, stop_strings(body),
                           keepalive_s=state.config.sse_keepalive) as events,
                EventStream(request) as stream):
        await stream.send(reply.chunk(Delta(role="assistant", content="")))
        async for event in events:
            if isinstance(event, KeepAlive):
                await stream.keep_alive()
            elif isinstance(event, Piece):
                logprobs = reply.logprobs_of(event)
                if event.text or logprobs:
                    await stream.send(reply.chunk(Delta(content=event.text), logprobs=logprobs))
            elif isinstance(event, Finished):
                await stream.send(reply.chunk(Delta(), finish_reason=event.finish_reason))
                if include_usage:
                    await stream.send(ChatCompletionChunk(reply.rid, reply.created, reply.model, [],
                                                          usage_info(event.usage)))
    return stream.response


class _Reply:
    """The fields every response of one request repeats."""

    def __init__(self, rid: str, created: int, model: str, logprobs: bool, tokenizer: PromptTokenizer):
        self.rid, self.created, self.model, self.logprobs, self.tokenizer = rid, created, model, logprobs, tokenizer

    def logprobs_of(self, piece: Piece) -> list[TokenLogprob]:
        return token_logprobs(piece.tokens, self.tokenizer) if self.logprobs else []

    def chunk(self, delta: Delta, *, finish_reason: str | None = None,
              logprobs: list[TokenLogprob] | None = None) -> ChatCompletionChunk:
        choice = ChunkChoice(0, delta, finish_reason, ChoiceLogprobs(logprobs) if logprobs else None)
        return ChatCompletionChunk(self.rid, self.created, self.model, [choice])

