"""One request's run through the engine, as text: what every API route streams from.

The engine speaks token ids; clients want text cut at stop strings. This layer
submits the request, turns each token into released text (detokenizer, then the
stop-string matcher), and tells the engine to finish as soon as a stop string
matches. Routes only format what it yields, so another API (Anthropic's
/v1/messages) or a parser over the text (tool calls, reasoning) plugs in here
without touching the engine.

Rules:
- whatever way the consumer leaves (finished, client gone, handler
  cancelled), `generation` cancels every choice's engine handle on exit, so a
  slot never outlives its client;
- n choices stream side by side, each event tagged with its choice's index; a
  choice that fails ends alone (`ChoiceFinished` with finish_reason "error") while
  another choice lives on, and a request whose every choice failed raises its
  failure (with n = 1, as soon as it fails).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator

from kvfork.server.engine.api import DoneEvent, GenerateRequest, TokenEvent, Usage
from kvfork.server.guard.errors import ApiError
from kvfork.server.text.detokenizer import IncrementalDetokenizer
from kvfork.server.text.stops import StopMatcher
from kvfork.server.text.tokenizer import PromptTokenizer


@dataclass
class Piece:
    text: str  # newly released text, possibly "" while a character or stop string is held
    tokens: list[TokenEvent] = field(default_factory=list)  # the tokens that arrived with it
    reused: int = 0  # the prompt tokens the request reused (final once it has a token: Usage.reused_tokens)


@dataclass
class ChoiceFinished:
    finish_reason: str  # "stop" or "length"; "error" for one failed choice of several
    usage: Usage
    stop_string: str | None = None  # the stop string that ended the text, if one did


class KeepAliveTick:
    """Nothing arrived for a while (a long prefill or a queue wait)."""


KEEP_ALIVE = KeepAliveTick()


class ChoiceFailed(ApiError):
    """A choice the engine failed (or cancelled); its usage still counts."""

    def __init__(self, status: int, message: str, code: str, usage: Usage):
        super().__init__(status, message, code=code)
        self.usage = usage


@asynccontextmanager
async def generation(engine, request: GenerateRequest, tokenizer: PromptTokenizer, stops: list[str],
                     keepalive_s: float | None = None, markup: bool = False
                     ) -> AsyncIterator[AsyncIterator[tuple[int, Piece | ChoiceFinished] | KeepAliveTick]]:
    """Submit now (an engine refusal raises here, before any response starts); yield (choice, event)
    pairs, and KeepAlives while nothing arrives. `markup`: the text keeps the model's markup tokens, for
    an output parser to read (PromptTokenizer.decode_markup)."""
    handles = [engine.submit(request)] if request.n == 1 else engine.submit_choices(request)
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, handle) -> None:
        try:
            async for event in _events(handle, tokenizer, stops, markup):
                arrived.put_nowait((index, event))
        except ChoiceFailed as failed:
            arrived.put_nowait((index, failed))

    pumps = [asyncio.create_task(pump(i, handle)) for i, handle in enumerate(handles)]
    stream = _merged(arrived, len(handles), keepalive_s)
    try:
        yield stream
    finally:
        # The engine handles first, before any await: a handler cancelled again while this block
        # awaits (aiohttp cancels it when its client goes) would skip the rest, and the request
        # would run on to its last token with no one reading.
        for handle in handles:
            if handle.done is None:
                handle.cancel()
        for task in pumps:
            task.cancel()
        await stream.aclose()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _merged(arrived: asyncio.Queue, n: int,
                  keepalive_s: float | None) -> AsyncIterator[tuple[int, Piece | ChoiceFinished] | KeepAliveTick]:
    running, failures = n, []
    while running:
        try:
            async with asyncio.timeout(keepalive_s):  # a queue: a timeout loses nothing
                index, event = await arrived.get()
        except TimeoutError:
            yield KEEP_ALIVE
            continue
        if isinstance(event, ChoiceFailed):
            failures.append(event)
            if len(failures) == n:
                raise failures[0]
            event = ChoiceFinished("error", event.usage)
        if isinstance(event, ChoiceFinished):
            running -= 1
        yield index, event


async def _events(handle, tokenizer: PromptTokenizer, stops: list[str],
                  markup: bool) -> AsyncIterator[Piece | ChoiceFinished]:
    detokenizer = IncrementalDetokenizer(tokenizer.decode_markup if markup else tokenizer.decode)
    matcher = StopMatcher(stops)
    stopped = False
    while True:
        event = await anext(handle)
        if isinstance(event, TokenEvent):
            if stopped:
                continue  # tokens the engine ran before it saw finish()
            match = matcher.feed(detokenizer.add(event.token))
            yield Piece(match.text, [event], handle.reused)
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
                yield Piece(text, reused=handle.reused)
            stopped = tail.stopped
        yield ChoiceFinished("stop" if stopped else event.finish_reason, event.usage, matcher.matched)
        return


def _failure(event: DoneEvent) -> ChoiceFailed:
    if event.finish_reason == "cancelled":
        return ChoiceFailed(503, "the request was cancelled: the server is shutting down", "cancelled", event.usage)
    if event.gave_way:
        return ChoiceFailed(429, event.error or "the queue is full", "queue_full", event.usage)
    if event.grammar_failed:  # the request's own grammar (a 400: a client must not retry it as a server error)
        return ChoiceFailed(400, f"the grammar failed while generating: {event.error}", "invalid_grammar",
                            event.usage)
    return ChoiceFailed(503, f"generation failed: {event.error or 'engine error'}", "engine_error", event.usage)
