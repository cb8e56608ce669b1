"""One request's run through the engine, as text: what every API route streams from.

The engine speaks token ids; clients want text cut at stop strings. This layer
submits the request, turns each token into released text (detokenizer, then the
stop-string matcher), and tells the engine to finish as soon as a stop string
matches. Routes only format what it yields, so another API (Anthropic's
/v1/messages) or a parser over the text (tool calls, reasoning) plugs in here
without touching the engine.

Rule: whatever way the consumer leaves (finished, client gone, handler
cancelled), `generation` cancels the engine handle on exit, so a slot never
outlives its client.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from server.engine.api import DoneEvent, GenerateRequest, TokenEvent, Usage
from server.errors import ApiError
from server.text.detokenizer import IncrementalDetokenizer
from server.text.stops import StopMatcher
from server.text.tokenizer import PromptTokenizer


@dataclass
class Piece:
    text: str  # newly released text, possibly "" while a character or stop string is held
    tokens: list[TokenEvent] = field(default_factory=list)  # the tokens that arrived with it


@dataclass
class Finished:
    finish_reason: str  # "stop" or "length"
    usage: Usage


class KeepAlive:
    """Nothing arrived for a while (a long prefill or a queue wait)."""


KEEP_ALIVE = KeepAlive()


@asynccontextmanager
async def generation(engine, request: GenerateRequest, tokenizer: PromptTokenizer, stops: list[str],
                     keepalive_s: float | None = None) -> AsyncIterator[AsyncIterator[Piece | Finished | KeepAlive]]:
    """Submit now (an engine refusal raises here, before any response starts); yield the events."""
    handle = engine.submit(request)
    stream = _events(handle, tokenizer, stops, keepalive_s)
    try:
        yield stream
    finally:
        await stream.aclose()
        if handle.done is None:
            handle.cancel()


async def _events(handle, tokenizer: PromptTokenizer, stops: list[str],
                  keepalive_s: float | None) -> AsyncIterator[Piece | Finished | KeepAlive]:
    detokenizer, matcher = IncrementalDetokenizer(tokenizer.decode), StopMatcher(stops)
    stopped = False
    while True:
        try:
            async with asyncio.timeout(keepalive_s):  # the handle is a queue: a timeout loses nothing
                event = await anext(handle)
        except TimeoutError:
            yield KEEP_ALIVE
            continue
        if isinstance(event, TokenEvent):
            if stopped:
                continue  # tokens the engine ran before it saw finish()
            match = matcher.feed(detokenizer.add(event.token))
            yield Piece(match.text, [event])
            if match.stopped:
                stopped = True
                handle.finish()
            continue
        if event.finish_reason in ("error", "cancelled"):
            raise _failure(event)
        if not stopped:
            tail = matcher.feed(detokenizer.flush())
            text = tail.text if tail.stopped else tail.text + matcher.flush()
            if text:
                yield Piece(text)
            stopped = tail.stopped
        yield Finished("stop" if stopped else event.finish_reason, event.usage)
        return


def _failure(event: DoneEvent) -> ApiError:
    if event.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled: the server is shutting down", code="cancelled")
    return ApiError(503, f"generation failed: {event.error or 'engine error'}", code="engine_error")
