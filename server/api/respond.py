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
every API. n choices are n replies (each saying its choice's index) under one
`Choices`, which says the usage once, after the last choice. Refusals raise before the response starts; once a stream has begun a
failure goes out as the API's error frame (`EventStream` and its subclasses).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import msgspec
from aiohttp import hdrs, web

from kvfork.server.api.content_encoding import coding_of, decoded
from kvfork.server.api.diagnosis import FINGERPRINTS, Report
from kvfork.server.api.openai import PromptTokensDetails, UsageInfo, encoder
from kvfork.server.api.sse import EventStream
from kvfork.server.common.state import ModelState, services_of
from kvfork.server.engine.api import GenerateRequest, Usage
from kvfork.server.generate.chat_output import ChatOutputParser
from kvfork.server.generate.generation import ChoiceFinished, KeepAliveTick, Piece, generation
from kvfork.server.guard.errors import ApiError, from_decode, client_text
from kvfork.server.guard.limits import Limits, check_depth

# Bodies larger than this are checked and decoded on a thread: a 16 MiB body takes tens of milliseconds.
OFF_LOOP_BYTES = 256 * 1024

log = logging.getLogger("kvfork.http")


def decoder(kind: type) -> msgspec.json.Decoder:
    """Built when a route module loads, so a type msgspec cannot decode fails at import, not per request."""
    return msgspec.json.Decoder(kind)


async def read_body(request: web.Request, decode: msgspec.json.Decoder):
    """The body, decoded: within --body-timeout and --max-body-bytes (sent, and inflated from its
    Content-Encoding: content_encoding.py), nested at most --max-json-depth."""
    services = services_of(request)
    coding = coding_of(",".join(request.headers.getall(hdrs.CONTENT_ENCODING, ())))
    raw = await services.clients.read_body(request)
    if coding is not None:
        raw = await asyncio.to_thread(decoded, raw, coding, services.config.max_body_bytes)
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(decode_body, raw, decode, services.config)
    return decode_body(raw, decode, services.config)


def decode_body(raw: bytes, decode: msgspec.json.Decoder, limits: Limits):
    check_depth(raw, limits)
    try:
        return decode.decode(raw)
    except msgspec.MsgspecError as e:
        raise from_decode(e) from None
    except RecursionError:  # what the depth check missed in a body that is no JSON anyway
        raise ApiError(400, "the body nests too deep to read (--max-json-depth)", code="limit_exceeded") from None


DROPPED_TOOLS = web.RequestKey("dropped_tools", list)
DROPPED_TOOLS_HEADER = "X-Kvfork-Dropped-Tools"
_LOGGED_TOOLS = 8  # names a log line shows of the tools one request dropped


def report_dropped_tools(request: web.Request, dropped: list[str]) -> None:
    """Tools a request offered that the model never sees (kinds nothing here runs, such as web_search):
    named in the log (escaped and bounded: they are the client's strings) and counted in the response's
    X-Kvfork-Dropped-Tools header (app.py sets it; no client string goes into a header)."""
    if dropped:
        request[DROPPED_TOOLS] = dropped
        names = ", ".join(client_text(name) for name in dropped[:_LOGGED_TOOLS])
        more = f" and {len(dropped) - _LOGGED_TOOLS} more" if len(dropped) > _LOGGED_TOOLS else ""
        log.info("%s %s: tools dropped (nothing here runs them): %s%s", request.method, request.path, names, more)


def dropped_tools_header(request: web.Request, response: web.StreamResponse) -> None:
    dropped = request.get(DROPPED_TOOLS)
    if dropped:
        response.headers[DROPPED_TOOLS_HEADER] = str(len(dropped))


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
    n: int = 1  # choices: the prompt is prefilled once, choice i samples with seed + i
    diagnostics: Report | None = None  # when the request asked for cache diagnostics (server/api/diagnosis.py)


class Reply(Protocol):
    stream_type: type[EventStream]  # the API's SSE framing

    def start(self) -> list[Any]: ...

    def piece(self, piece: Piece) -> list[Any]: ...

    def finish(self, done: ChoiceFinished) -> list[Any]: ...

    def whole(self) -> Any: ...


class ChoiceReply(Reply, Protocol):
    """A reply that can say one of several choices (chat, completions): built for its choice's index
    without the usage, which `usage(usage)` says once for them all."""

    def usage(self, usage: Usage) -> list[Any]: ...


def total_usage(usages: list[Usage]) -> Usage:
    """n choices' usage: the prompt once (choice 0's, the one that computed it), completions summed."""
    return replace(usages[0], generated_tokens=sum(u.generated_tokens for u in usages))


class Choices:
    """n replies as one: each choice's frames from its own reply, the usage once after the last."""

    def __init__(self, replies: list[Any], include_usage: bool = False):
        self.replies, self.include_usage = replies, include_usage
        self.stream_type = replies[0].stream_type
        self.done: list[ChoiceFinished | None] = [None] * len(replies)
        self.ended: Callable[[Usage], None] | None = None  # told choice 0's usage (it holds the prompt's)

    def start(self) -> list[Any]:
        return [frame for reply in self.replies for frame in reply.start()]

    def piece(self, index: int, piece: Piece) -> list[Any]:
        return self.replies[index].piece(piece)

    def finish(self, index: int, done: ChoiceFinished) -> list[Any]:
        self.done[index] = done
        if index == 0 and self.ended is not None:
            self.ended(done.usage)
        frames = self.replies[index].finish(done)
        if self.include_usage and all(self.done):
            frames += self.replies[0].usage(self.usage())
        return frames

    def usage(self) -> Usage:
        return total_usage([done.usage for done in self.done if done is not None])

    def whole(self) -> Any:
        if len(self.replies) == 1:
            return self.replies[0].whole()
        bodies = [reply.whole() for reply in self.replies]
        body = bodies[0]
        body.choices = [choice for b in bodies for choice in b.choices]
        body.usage = usage_info(self.usage())
        return body


async def respond(request: web.Request, model: ModelState, job: Job, reply: Reply | Choices,
                  stream: bool) -> web.StreamResponse:
    """Run `job` on `model` and answer with `reply` (one reply, or `Choices` for n > 1): one JSON body, or a
    stream of its frames."""
    tokenizer = model.require_ready()
    keepalive = model.config.sse_keepalive if stream else None
    choices = reply if isinstance(reply, Choices) else Choices([reply])
    scope, rid = job.generate.scope, job.generate.request_id
    digest = model.engine.serving.index.digest(scope) if model.engine.loaded else scope.tenant_hash
    reuse = services_of(request).reuse
    choices.ended = lambda usage: reuse.ended(rid, scope, digest, usage)
    async with generation(model.engine, job.generate, tokenizer, job.stops, keepalive_s=keepalive,
                          markup=job.parser is not None) as events:
        # admitted: a later request's diagnostics may name it (a fingerprint, or `unavailable` without one)
        if job.diagnostics is not None:
            job.diagnostics.keep(rid)
        else:
            request.app[FINGERPRINTS].made(rid, scope.tenant)
        if not stream:
            async for event in events:
                match event:
                    case (index, Piece() as piece):
                        choices.piece(index, piece)
                    case (index, ChoiceFinished() as done):
                        choices.finish(index, done)
            if not all(choices.done):
                raise ApiError(503, "the engine ended the request without a result", code="engine_error")
            return json_response(choices.whole())
        async with choices.stream_type(request) as out:
            await out.send_all(choices.start())
            async for event in events:
                match event:
                    case KeepAliveTick():
                        await out.keep_alive()
                    case (index, Piece() as piece):
                        await out.send_all(choices.piece(index, piece))
                        await out.keep_alive_if_quiet(keepalive)
                    case (index, ChoiceFinished() as done):
                        await out.send_all(choices.finish(index, done))
        return out.response
