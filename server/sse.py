"""Server-sent events: one `data:` frame per JSON body, comments as keep-alives, `[DONE]` last."""

from __future__ import annotations

import logging
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

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, body) -> None:
        await self.response.write(b"data: " + encoder.encode(body) + b"\n\n")

    async def keep_alive(self) -> None:
        await self.response.write(b": keep-alive\n\n")

    @asynccontextmanager
    async def reporting_errors(self):
        """Once the stream has started its status is sent: a failure goes out as an `error` frame,
        which OpenAI's clients read and raise."""
        try:
            yield
        except ApiError as e:
            await self.send(e.body())
        except ConnectionError:
            raise  # the client is gone: nothing to tell it
        except Exception:
            log.exception("unexpected error while streaming")
            await self.send(ApiError(500, "internal error", code="internal_error").body())

    async def close(self) -> web.StreamResponse:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
