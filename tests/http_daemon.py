"""A real daemon on 127.0.0.1 (any free port) for HTTP tests, and small helpers to talk to it."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

import aiohttp

from kvfork.backends import create_backend
from kvfork.backends.base import Backend
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.serve import Daemon

# Small budgets keep test runs light on a shared 2-core machine.
TEST_ENGINE = dict(kv_budget_bytes=256 * 1024 * 1024, inference_slots=4, prefix_cache_min_tokens=16)


@asynccontextmanager
async def serving(model: str, backend: Backend | None = None, *, load: bool = True, engine: dict | None = None,
                  **server) -> AsyncIterator[Daemon]:
    config = ServerConfig(model=model, port=0, shutdown_grace=1.0, **server)
    daemon = Daemon(config, EngineConfig(**{**TEST_ENGINE, **(engine or {})}), model,
                    backend or create_backend("mlx"))
    await daemon.listen()
    try:
        if load:
            await daemon.load()
        yield daemon
    finally:
        await daemon.close()


def reuse_off(name: str) -> dict:
    """A body's cache_salt of its own: the request runs in a scope where nothing was computed before, so it
    answers as the same request would with reuse off."""
    return {"cache_salt": f"reuse-off-{name}".ljust(16, "-")}


def chat_body(text: str = "the capital of France", **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


async def sse_events(response: aiohttp.ClientResponse) -> list[str]:
    """Every SSE line of a finished stream (data frames and comments), blank lines dropped."""
    lines = []
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line:
            lines.append(line)
    return lines


def data_frames(lines: list[str]) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


_SAMPLE = re.compile(r"^([a-z_:]+)(\{[^}]*\})? ([-+0-9.eEinfa]+)$")


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value}."""
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


async def until(read: Callable, check: Callable[[dict], bool], what: str, limit_s: float = 60.0) -> dict:
    """Poll `read()` until `check` holds; a bounded wait, not a timing assertion."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while True:
        value = await read()
        if check(value):
            return value
        assert loop.time() < deadline, f"never saw {what}: {value}"
        await asyncio.sleep(0.02)


async def first_token(response: aiohttp.ClientResponse) -> None:
    """Read a chat stream until its first content chunk."""
    async for line in response.content:
        if b'"content":"' in line and b'"role"' not in line:
            return
