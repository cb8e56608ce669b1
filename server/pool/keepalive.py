"""A streaming request waiting for its model to load hears keep-alives, as it does while queued: past
--sse-keepalive seconds of waiting its stream opens (200, SSE headers) and an SSE comment goes out every
--sse-keepalive seconds; the reply then writes into that stream. A failure after the stream opened (the
load failed, the body was refused) goes out as the API's error frame, as any failure inside a stream does."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web

from kvfork.server.api.messages.protocol import error_body
from kvfork.server.api.messages.route import PATH as MESSAGES_PATH
from kvfork.server.api.sse import OPENED, SSE_HEADERS
from kvfork.server.guard.errors import ApiError


class KeepAlive:
    """Keep-alives to `request` every `seconds` until `stop`, its stream opened at the first."""

    def __init__(self, request: web.Request, seconds: float):
        self.request, self.seconds = request, seconds
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.seconds)
                return
            except TimeoutError:
                pass
            response = self.request.get(OPENED)
            if response is None:
                response = self.request[OPENED] = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(self.request)
            await response.write(b": keep-alive\n\n")

    async def stop(self) -> None:
        self._stop.set()
        try:
            await self._task
        except ConnectionError:  # the client went away while waiting: its handler ends on the next write
            pass


async def error_in_stream(request: web.Request, error: ApiError) -> web.StreamResponse:
    """`error` into the stream opened early, in the shape of the API: Anthropic's error event on
    /v1/messages, else OpenAI's error frame and [DONE]."""
    response = request[OPENED]
    if request.path.startswith(MESSAGES_PATH):
        frame = b"event: error\ndata: " + error_body(error.status, error.message) + b"\n\n"
    else:
        frame = b"data: " + msgspec.json.encode(error.body()) + b"\n\ndata: [DONE]\n\n"
    try:
        await response.write(frame)
        await response.write_eof()
    except (ConnectionError, RuntimeError):  # the client went away, or the stream had ended already
        pass
    return response
