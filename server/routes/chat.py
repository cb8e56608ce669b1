"""POST /v1/chat/completions.

`prepare` is the one path from a chat request to prompt tokens and an output
parser; the Anthropic route (routes/messages.py) translates its body into a
chat request and takes the same path, so both get the same tokens and reuse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from server.chat_output import ChatOutputParser, collect, output_parser
from server.engine.api import GenerateRequest, TokenEvent
from server.errors import ApiError, invalid
from server.generation import Finished, KeepAlive, Piece, generation
from server.grammar import request_ask
from server.protocol.openai import (
    ChatChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage,
    ChoiceLogprobs, ChunkChoice, Delta, TokenLogprob, TopLogprob,
)
from server.routes.chat_tools import (
    assistant_message, check_tools, deltas, finish_reason, template_tool_calls, tool_choice_of,
)
from server.routes.common import decoder, json_response, read_body, usage_info
from server.sampling import check_supported, generate_request, request_id, session_id, stop_strings
from server.sse import EventStream
from server.state import AppState, state_of
from server.text.tokenizer import PromptTokenizer
from server.toolcalls.base import openai_call_id

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
    for key in ("name", "tool_call_id", "reasoning_content"):
        if getattr(message, key) is not None:
            out[key] = getattr(message, key)
    if message.tool_calls is not None:
        out["tool_calls"] = template_tool_calls(message.tool_calls)
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


@dataclass
class PreparedChat:
    model: str  # the name to answer with
    prompt: list[int]
    generate: GenerateRequest
    parser: ChatOutputParser
    stops: list[str]


async def prepare(state: AppState, body: ChatCompletionRequest, request: web.Request, rid: str,
                  make_call_id: Callable[[], str] = openai_call_id) -> PreparedChat:
    check_supported(body)
    if body.top_logprobs and not body.logprobs:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    model = state.model_name(body.model)
    session = session_id(body.session_id, request.headers.get("X-Session-ID"))
    messages = [template_message(i, m) for i, m in enumerate(body.messages)]
    choice, tool_name = tool_choice_of(body.tool_choice, check_tools(body.tools))
    tokenizer = state.require_ready()
    text = await tokenizer.render_chat(messages, body.tools, body.chat_template_kwargs)
    config = state.config
    parser = output_parser(config.tool_parser, config.reasoning_parser, tokenizer.chat_template, text, body.tools,
                           choice, tool_name, make_call_id)
    ask = request_ask(body.response_format, parser.tool_parser.name if parser.tool_parser else None, body.tools,
                      choice, tool_name, parser.prompt_suffix,  # type: ignore[arg-type]
                      parallel=body.parallel_tool_calls is not False)
    prompt = await tokenizer.encode_rendered(text)
    if parser.prompt_suffix:  # encoded on its own: the prompt before it keeps the tokens other turns share
        prompt += await tokenizer.encode_rendered(parser.prompt_suffix)
    generate = generate_request(
        body, prompt, rid=rid, vocab_size=state.engine.info.vocab_size,
        max_tokens=body.max_completion_tokens or body.max_tokens, session=session,
        logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0,
    )
    if ask is not None:
        generate.constraint = await state.grammars().compile(ask)
    return PreparedChat(model, prompt, generate, parser, stop_strings(body))


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body: ChatCompletionRequest = await read_body(request, DECODE)
    rid = request_id("chatcmpl")
    chat = await prepare(state, body, request, rid)
    tokenizer = state.require_ready()
    reply = _Reply(rid, int(time.time()), chat.model, body.logprobs, tokenizer)
    if body.stream:
        return await _stream(request, state, body, chat, reply)
    outputs = []
    logprobs: list[TokenLogprob] = []
    async with generation(state.engine, chat.generate, tokenizer, chat.stops) as events:
        async for event in events:
            if isinstance(event, Piece):
                outputs += chat.parser.feed(event.text)
                logprobs += reply.logprobs_of(event)
            elif isinstance(event, Finished):
                output = collect(outputs + chat.parser.finish())
                choice = ChatChoice(0, assistant_message(output), finish_reason(event.finish_reason,
                                    bool(output.tool_calls)), ChoiceLogprobs(logprobs) if body.logprobs else None)
                completion = ChatCompletion(rid, reply.created, chat.model, [choice], usage_info(event.usage))
                return json_response(completion)
    raise ApiError(503, "the engine ended the request without a result", code="engine_error")


async def _stream(request: web.Request, state: AppState, body: ChatCompletionRequest, chat: PreparedChat,
                  reply: "_Reply"):
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    calls = False
    async with (generation(state.engine, chat.generate, reply.tokenizer, chat.stops,
                           keepalive_s=state.config.sse_keepalive) as events,
                EventStream(request) as stream):
        await stream.send(reply.chunk(Delta(role="assistant", content="")))
        async for event in events:
            if isinstance(event, KeepAlive):
                await stream.keep_alive()
            elif isinstance(event, Piece):
                logprobs = reply.logprobs_of(event)
                out = deltas(chat.parser.feed(event.text)) or ([Delta(content="")] if logprobs else [])
                for i, delta in enumerate(out):  # the piece's logprobs ride on its first chunk
                    calls = calls or bool(delta.tool_calls)
                    await stream.send(reply.chunk(delta, logprobs=logprobs if i == 0 else None))
                await stream.keep_alive_if_quiet(state.config.sse_keepalive)
            elif isinstance(event, Finished):
                for delta in deltas(chat.parser.finish()):
                    calls = calls or bool(delta.tool_calls)
                    await stream.send(reply.chunk(delta))
                await stream.send(reply.chunk(Delta(), finish_reason=finish_reason(event.finish_reason, calls)))
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

