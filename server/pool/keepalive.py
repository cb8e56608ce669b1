"""A streaming request waiting for its model to load hears keep-alives, as it does while queued: past
--sse-keepalive seconds of waiting its stream opens (200, SSE headers) and an SSE comment goes out every
--sse-keepalive seconds; the reply then writes into that stream. A failure after the stream opened (the
load failed, the body was refused) goes out inside it in the API's shape, as any failure inside a stream does
(server/launch/app.py's error middleware writes it: the pool knows no API's shape)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvfork.server.api.sse import OPENED, SSE_HEADERS


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
