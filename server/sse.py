"""Server-sent events: one `data:` frame per JSON body, comments as keep-alives, `[DONE]` last."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from aiohttp import web

from server.errors import ApiError
from server.protocol.openai import encoder


log = logging.getLogger("kvfork.http")


class EventStream:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.last_write = time.monotonic()

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def write(self, frame: bytes) -> None:
        self.last_write = time.monotonic()
        await self.response.write(frame)

    async def send(self, body) -> None:
        await self.write(b"data: " + encoder.encode(body) + b"\n\n")

    async def keep_alive(self) -> None:
        await self.write(b": keep-alive\n\n")

    async def keep_alive_if_quiet(self, seconds: float) -> None:
        """Tokens can arrive with nothing to send (a long tool call is held until it closes):
        a keep-alive once in a while then keeps proxies and clients from timing out."""
        if time.monotonic() - self.last_write >= seconds:
            await self.keep_alive()

    @asynccontextmanager
    async def reporting_errors(self):
        """Once the stream has started its status is sent: a failure goes out as an `error` frame,
        which OpenAI's clients read and raise."""
        try:
            yield
        except ApiError as e:
            await self.send_error(e)
        except ConnectionError:
            raise  # the client is gone: nothing to tell it
        except Exception:
            log.exception("unexpected error while streaming")
            await self.send_error(ApiError(500, "internal error", code="internal_error"))

    async def send_error(self, error: ApiError) -> None:
        await self.send(error.body())

    async def close(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
