"""What every API route shares: reading a body, the usage block, and the one response driver.

Every route is `prepare` (its body → a `Job`: prompt tokens, the engine
request, stop strings, the output parser), then `respond`: the job runs through
`generation`, and a per-API `Reply` says each step in the API's own shape. The
APIs differ only in their reply:

    start()          frames opening a stream (a role chunk, message_start, response.created ...)
    piece(piece)     frames for newly released text (and its tokens' logprobs)
    finish(done)     frames closing the stream (finish chunk, usage ...)
    whole()          the non-streamed body, once `finish` has been called

Design rule: a request's sampling constraint and its number of choices live in
the `Job`, below the routes, so constrained decoding and n > 1 are done once for
every API. Refusals raise before the response starts; once a stream has begun a
failure goes out as the API's error frame (`EventStream` and its subclasses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from aiohttp import web

from server.chat_output import ChatOutputParser
from server.engine.api import GenerateRequest, Usage
from server.errors import ApiError, from_decode
from server.generation import Finished, KeepAlive, Piece, generation
from server.protocol.openai import PromptTokensDetails, UsageInfo, encoder
from server.sse import EventStream
from server.state import AppState


def decoder(kind: type) -> msgspec.json.Decoder:
    """Built when a route module loads, so a type msgspec cannot decode fails at import, not per request."""
    return msgspec.json.Decoder(kind)


async def read_body(request: web.Request, decode: msgspec.json.Decoder):
    raw = await request.read()  # over --max-body-bytes: aiohttp raises 413 here
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        return decode.decode(raw)
    except msgspec.MsgspecError as e:
        raise from_decode(e) from None


def usage_info(usage: Usage) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.generated_tokens,
        total_tokens=usage.prompt_tokens + usage.generated_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.reused_tokens),
    )


def json_response(body, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encoder.encode(body), content_type="application/json")


@dataclass
class Job:
    """One request ready for the engine, whatever API it came through."""

    model: str  # the name to answer with
    prompt: list[int]
    generate: GenerateRequest
    stops: list[str]
    parser: ChatOutputParser | None = None  # chat-shaped APIs split reasoning and tool calls from the text
    n: int = 1  # choices asked for; the routes refuse n > 1 until it is served


class Reply(Protocol):
    stream_type: type[EventStream]  # the API's SSE framing

    def start(self) -> list[Any]: ...

    def piece(self, piece: Piece) -> list[Any]: ...

    def finish(self, done: Finished) -> list[Any]: ...

    def whole(self) -> Any: ...


async def respond(request: web.Request, state: AppState, job: Job, reply: Reply, stream: bool) -> web.StreamResponse:
    """Run `job` and answer with `reply`: one JSON body, or a stream of its frames."""
    tokenizer = state.require_ready()
    keepalive = state.config.sse_keepalive if stream else None
    async with generation(state.engine, job.generate, tokenizer, job.stops, keepalive_s=keepalive) as events:
        if not stream:
            async for event in events:
                if isinstance(event, Piece):
                    reply.piece(event)
                elif isinstance(event, Finished):
                    reply.finish(event)
                    return json_response(reply.whole())
            raise ApiError(503, "the engine ended the request without a result", code="engine_error")
        async with reply.stream_type(request) as out:
            await out.send_all(reply.start())
            async for event in events:
                if isinstance(event, KeepAlive):
                    await out.keep_alive()
                elif isinstance(event, Piece):
                    await out.send_all(reply.piece(event))
                    await out.keep_alive_if_quiet(keepalive)
                elif isinstance(event, Finished):
                    await out.send_all(reply.finish(event))
        return out.response
