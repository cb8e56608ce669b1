"""POST /v1/completions: a prompt given as text or as token ids."""

from __future__ import annotations

import time

from aiohttp import web

from server.errors import ApiError, invalid, unsupported
from server.generation import Finished, KeepAlive, Piece, generation
from server.protocol.openai import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest
from server.routes.common import decoder, json_response, read_body, usage_info
from server.sampling import check_supported, generate_request, request_id, session_id, stop_strings
from server.sse import EventStream
from server.state import AppState, state_of
from server.text.tokenizer import PromptTokenizer

DECODE = decoder(CompletionRequest)


async def prompt_tokens(prompt: str | list, tokenizer: PromptTokenizer, vocab_size: int) -> list[int]:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise unsupported("prompt", "a batch of prompts is not supported; send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = await tokenizer.text(prompt)
    elif all(isinstance(t, int) for t in prompt):
        tokens = prompt
        if any(not 0 <= t < vocab_size for t in tokens):
            raise invalid("prompt", f"prompt token ids must be in [0, {vocab_size})")
    else:
        raise invalid("prompt", "the prompt is a string, a list of token ids, or a list holding one of those")
    if not tokens:
        raise invalid("prompt", "the prompt is empty")
    return tokens


class _Reply:
    """The fields every response of one request repeats, and OpenAI's legacy logprobs block."""

    def __init__(self, rid: str, model: str, tokenizer: PromptTokenizer, logprobs: bool, offset: int):
        self.rid, self.created, self.model = rid, int(time.time()), model
        self.tokenizer, self.logprobs, self.offset = tokenizer, logprobs, offset
        self.all_logprobs = CompletionLogprobs([], [], [], [])

    def chunk(self, text: str, finish: str | None = None, piece: Piece | None = None) -> Completion:
        logprobs = self.logprobs_of(piece) if self.logprobs and piece else None
        return Completion(self.rid, self.created, self.model, [CompletionChoice(0, text, finish, logprobs)])

    def usage_chunk(self, usage) -> Completion:
        return Completion(self.rid, self.created, self.model, [], usage_info(usage))

    def logprobs_of(self, piece: Piece) -> CompletionLogprobs | None:
        out = CompletionLogprobs([], [], [], [])
        for event in piece.tokens:
            if event.logprob is None:
                continue
            text = self.tokenizer.token_text(event.token)
            out.tokens.append(text)
            out.token_logprobs.append(event.logprob)
            out.top_logprobs.append({self.tokenizer.token_text(t): lp for t, lp in event.top_logprobs or ()})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self.all_logprobs, name).extend(getattr(out, name))
        return out if out.tokens else None


async def handle(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body: CompletionRequest = await read_body(request, DECODE)
    check_supported(body)
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "best_of > 1 is not supported yet")
    if body.suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported")
    if body.echo and body.logprobs is not None:
        raise unsupported("echo", "echo with logprobs is not supported: prompt logprobs are not computed")
    model = state.model_name(body.model)
    session = session_id(body.session_id, request.headers.get("X-Session-ID"))
    tokenizer = state.require_ready()
    vocab = state.engine.info.vocab_size
    prompt = await prompt_tokens(body.prompt, tokenizer, vocab)
    rid = request_id("cmpl")
    generate = generate_request(
        body, prompt, rid=rid, vocab_size=vocab,
        max_tokens=body.max_tokens, session=session, logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )
    echo = tokenizer.decode(prompt) if body.echo else ""
    reply = _Reply(rid, model, tokenizer, body.logprobs is not None, len(echo))
    if body.stream:
        return await _stream(request, state, body, generate, reply, echo)
    texts = [echo]
    async with generation(state.engine, generate, tokenizer, stop_strings(body)) as events:
        async for event in events:
            if isinstance(event, Piece):
                texts.append(event.text)
                if reply.logprobs:
                    reply.logprobs_of(event)
            elif isinstance(event, Finished):
                choice = CompletionChoice(0, "".join(texts), event.finish_reason,
                                          reply.all_logprobs if reply.logprobs else None)
                return json_response(Completion(rid, reply.created, model, [choice], usage_info(event.usage)))
    raise ApiError(503, "the engine ended the request without a result", code="engine_error")


async def _stream(request: web.Request, state: AppState, body: CompletionRequest, generate, reply: _Reply,
                  echo: str) -> web.StreamResponse:
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    async with (generation(state.engine, generate, reply.tokenizer, stop_strings(body),
                           keepalive_s=state.config.sse_keepalive) as events,
                EventStream(request) as stream):
        if echo:
            await stream.send(reply.chunk(echo))
        async for event in events:
            if isinstance(event, KeepAlive):
                await stream.keep_alive()
            elif isinstance(event, Piece):
                chunk = reply.chunk(event.text, piece=event)
                if event.text or chunk.choices[0].logprobs:
                    await stream.send(chunk)
            elif isinstance(event, Finished):
                await stream.send(reply.chunk("", event.finish_reason))
                if include_usage:
                    await stream.send(reply.usage_chunk(event.usage))
    return stream.response
