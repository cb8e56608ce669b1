"""Slow clients: a connection may not hold the daemon open by sending or reading too slowly.

aiohttp has no header or body read timeout (its keep-alive timeout, 3,630 s in 3.14, is the only
clock), so a client that sends half a request head, or announces a 16 MB body and sends one byte,
keeps its connection and handler forever; and a streaming client that reads nothing keeps its
handler waiting on a write forever. Three bounds (server/guard/limits.py), each counted in /metrics:

- the head: a per-connection watchdog (`Watchdog`, wrapping aiohttp's protocol) closes a connection
  that has not delivered a complete request head within --header-timeout of its opening or of the
  end of its previous request (an idle keep-alive connection is closed then too, uncounted);
- the body: `read_body` reads it under asyncio.timeout(--body-timeout), then closes the connection;
- the writes: while the transport's buffer is full, the watchdog judges progress: a client that
  drained less than MIN_DRAINED bytes of it in one --write-timeout is cut off (a slow but steady
  reader of a large reply is not, one that reads nothing or a trickle is); aiohttp then cancels the
  handler, whose generation cancels its engine request (handler_cancellation, server/launch/app.py).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, Callable

from aiohttp import web

from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.limits import Limits
from kvfork.server.watch.metrics import Registry

# Bytes of a full write buffer a client must drain per --write-timeout to keep its connection: 2 KiB/s
# at the default 30 s, far below any real reader, far above one that trickles a byte at a time.
MIN_DRAINED = 64 * 1024


class SlowClients:
    """The bounds and their counters, for the watchdogs and the body reads."""

    def __init__(self, registry: Registry, limits: Limits):
        self.limits = limits
        self.read_timeouts = registry.counter("http_read_timeouts_total", "connections closed for a request head "
                                              "or body that did not arrive in time, by phase (header, body)")
        self.write_timeouts = registry.counter("http_write_timeouts_total", "connections closed, and their "
                                               "requests cancelled, for a client that read nothing for "
                                               "--write-timeout")

    async def read_body(self, request: web.Request) -> bytes:
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                return await request.read()  # over --max-body-bytes: aiohttp raises 413 here
        except TimeoutError:
            self.read_timeouts.inc(phase="body")
            if request.transport is not None:
                reset(request.transport)
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s "
                           "(--body-timeout)", code="timeout") from None


class Watchdog(asyncio.Protocol):
    """One connection's clock, around aiohttp's protocol for it (every call is passed on)."""

    def __init__(self, inner: asyncio.Protocol, clients: SlowClients):
        self.inner, self.clients = inner, clients
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.in_request = False
        self.head_since: float | None = None  # when the wait for the next request head began
        self.head_bytes = False  # some of that head has arrived (a partial head, not an idle connection)
        self.paused_since: float | None = None  # when the transport's write buffer filled up, or last drained
        self.paused_buffer = 0  # the buffer's size then
        self._timer: asyncio.TimerHandle | None = None

    @staticmethod
    def of(request: web.Request) -> "Watchdog | None":
        transport = request.transport
        protocol = transport.get_protocol() if transport is not None else None
        return protocol if isinstance(protocol, Watchdog) else None

    # ---- the protocol, passed on ----

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.inner.connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if not self.in_request:
            self.head_bytes = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._disarm()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._progress()
        self._arm()
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.paused_since = None
        self._arm()
        self.inner.resume_writing()

    # ---- from the middleware ----

    def request_started(self) -> None:
        self.in_request, self.head_since = True, None
        self._arm()

    def request_ended(self) -> None:
        self.in_request = False
        self._await_head()

    # ---- the clock ----

    def _await_head(self) -> None:
        self.head_since, self.head_bytes = self.loop.time(), False
        self._arm()

    def _deadlines(self) -> list[tuple[float, Callable[[], bool | None]]]:
        """(when, what then): the action counts what it cuts off and says whether to reset (a slow client)
        rather than close (an idle one, which may still be reading the last answer); None: not cut off."""
        limits, out = self.clients.limits, []
        if self.transport is None:  # closed (by us or the client): nothing to watch
            return out
        if self.paused_since is not None:
            out.append((self.paused_since + limits.write_timeout, self._write_stalled))
        elif self.head_since is not None and not self.in_request:
            out.append((self.head_since + limits.header_timeout, self._head_late))
        return out

    def _progress(self) -> None:
        self.paused_since = self.loop.time()
        self.paused_buffer = self.transport.get_write_buffer_size() if self.transport is not None else 0

    def _write_stalled(self) -> bool | None:
        """None (watch on) when the client drained MIN_DRAINED bytes since the last look, else cut it off."""
        assert self.transport is not None  # _deadlines has none without one
        if self.paused_buffer - self.transport.get_write_buffer_size() >= MIN_DRAINED:
            self._progress()
            return None
        self.clients.write_timeouts.inc()
        return True

    def _head_late(self) -> bool:
        if self.head_bytes:
            self.clients.read_timeouts.inc(phase="header")
        return self.head_bytes

    def _arm(self) -> None:
        self._disarm()
        deadlines = self._deadlines()
        if deadlines:
            self._timer = self.loop.call_at(min(at for at, _ in deadlines), self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        now = self.loop.time()
        for at, cut_off in self._deadlines():
            if now >= at:
                slow = cut_off()
                if slow is None:
                    break
                transport, self.transport = self.transport, None
                if transport is not None:
                    reset(transport) if slow else transport.close()
                return
        self._arm()


def reset(transport: asyncio.BaseTransport) -> None:
    """Close at once with a reset: what the kernel still holds for a client that reads nothing (megabytes of
    a stream) is dropped rather than kept trying to send. connection_lost follows: aiohttp cancels the
    handler, whose generation cancels its engine request."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


async def listen(runner: web.AppRunner, host: str, port: int, clients: SlowClients) -> asyncio.Server:
    """Serve `runner`'s application (set up) on host:port, each connection under a Watchdog."""
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: Watchdog(server(), clients), host, port)
