"""Helpers for engine tests: an engine on a backend, requests, and reading a stream to its end."""

from __future__ import annotations

import asyncio
from typing import Sequence

from backends.base import Backend, SamplingParams
from server.engine.api import DoneEvent, GenerateRequest, TokenEvent
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.engine.request import RequestHandle
from server.metrics import Registry

# Small enough for scripted prompts, and an explicit budget so no test depends on the machine's memory.
TEST_CONFIG = dict(prefix_cache_min_tokens=8, kv_budget_bytes=1 << 30)


async def start_engine(backend: Backend, model_path: str = "scripted", **config) -> Engine:
    engine = Engine(backend, model_path, None, EngineConfig(**{**TEST_CONFIG, **config}), Registry())
    await engine.start()
    return engine


def request(prompt: Sequence[int], max_tokens: int = 8, rid: str = "r", **kw) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams())
    return GenerateRequest(rid, list(prompt), sampling, max_tokens, **kw)


async def collect(handle: RequestHandle, timeout: float = 30.0) -> tuple[list[int], DoneEvent]:
    """Every token of a stream, and its DoneEvent (the timeout only guards against a hang)."""
    async def read() -> tuple[list[int], DoneEvent]:
        tokens = []
        async for event in handle:
            if isinstance(event, TokenEvent):
                tokens.append(event.token)
            else:
                return tokens, event
        raise AssertionError("stream ended without a DoneEvent")
    return await asyncio.wait_for(read(), timeout)


async def run(engine: Engine, prompt: Sequence[int], max_tokens: int = 8, **kw) -> tuple[list[int], DoneEvent]:
    return await collect(engine.submit(request(prompt, max_tokens, **kw)))


async def until(predicate, timeout: float = 10.0) -> None:
    """Yield to the loop until `predicate()` holds (guards against a hang, asserts nothing about time)."""
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), timeout)


async def reached(gate, timeout: float = 10.0) -> None:
    """Wait until the runner is held inside the gated backend call."""
    assert await asyncio.to_thread(gate.reached.wait, timeout), "the runner never reached the gate"


def prompt_of(n: int, start: int = 3) -> list[int]:
    return [3 + (start + i * 7) % 500 for i in range(n)]


def stored_sessions(engine: Engine) -> int:
    """Sessions the engine keeps on purpose: prefix cache snapshots and named sessions' state."""
    adm = engine.admission
    return len(adm.cache) + adm.named.holding()


async def settled(engine: Engine, backend, extra: int = 0) -> None:
    """Wait until the runner has released what the engine let go of (releases are asynchronous):
    the backend then holds exactly the stored sessions, plus `extra` still in use."""
    await until(lambda: backend.live_sessions() == stored_sessions(engine) + extra)
