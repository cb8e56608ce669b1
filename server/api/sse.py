"""Server-sent events: one `data:` frame per JSON body, comments as keep-alives, `[DONE]` last.

Once a stream has started, its status line is gone: a failure inside the
`async with` block goes out as an `error` frame (OpenAI's clients read it and
raise), and a client that went away ends the block quietly.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from kvfork.server.api.openai import encoder
from kvfork.server.guard.errors import ApiError

log = logging.getLogger("kvfork.http")
CLIENT_GONE = web.RequestKey("client_gone", bool)  # set when a write found the connection closed
# A stream opened before its reply, its keep-alives sent while the model loads (server/pool/keepalive.py)
OPENED = web.RequestKey("opened_stream", web.StreamResponse)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = request.get(OPENED) or web.StreamResponse(headers=SSE_HEADERS)
        self.last_write = time.monotonic()

    async def __aenter__(self) -> "EventStream":
        if not self.response.prepared:
            await self.response.prepare(self.request)
        return self

    async def __aexit__(self, kind, error, traceback) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # cancellation: the handler was cancelled with its client
        try:
            if isinstance(error, ApiError):
                await self.send_error(error)
            elif error is not None and not isinstance(error, ConnectionError):
                log.error("unexpected error while streaming", exc_info=error)
                await self.send_error(ApiError(500, "internal error", code="internal_error"))
            if not isinstance(error, ConnectionError):
                await self.finish()
        except ConnectionError:
            error = error or ConnectionError()
        if isinstance(error, ConnectionError):
            self.request[CLIENT_GONE] = True
        return True

    async def write(self, frame: bytes) -> None:
        self.last_write = time.monotonic()
        await self.response.write(frame)

    async def send(self, body) -> None:
        await self.write(b"data: " + encoder.encode(body) + b"\n\n")

    async def send_all(self, bodies: list) -> None:
        for body in bodies:
            await self.send(body)

    async def send_error(self, error: ApiError) -> None:
        await self.send(error.body())

    async def finish(self) -> None:
        await self.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

    async def keep_alive(self) -> None:
        await self.write(b": keep-alive\n\n")

    async def keep_alive_if_quiet(self, seconds: float) -> None:
        """Tokens can arrive with nothing to send (a long tool call is held until it closes):
        a keep-alive once in a while then keeps proxies and clients from timing out."""
        if time.monotonic() - self.last_write >= seconds:
            await self.keep_alive()
