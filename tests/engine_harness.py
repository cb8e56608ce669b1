"""Helpers for engine tests: an engine on a backend, requests, and reading a stream to its end."""

from __future__ import annotations

import asyncio
import importlib
from typing import Sequence

import pytest

from kvfork.backends import BACKENDS
from kvfork.backends.base import Backend, SamplingParams
from kvfork.server.engine.api import DoneEvent, GenerateRequest, TokenEvent
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.engine.loop.request import RequestHandle
from kvfork.server.engine.worker.plan import StepPlan
from kvfork.server.watch.metrics import Registry
from scripted_drafts import ScriptedDrafts

# Small enough for scripted prompts, and an explicit budget so no test depends on the machine's memory.
# Plain decode steps (one row per request) unless a test asks for speculative decoding: the daemon's own
# default (suffix) runs in the HTTP tests.
TEST_CONFIG = dict(prefix_cache_min_tokens=8, kv_budget_bytes=1 << 30, speculative="off")
# Every reuse path off: the reference the reuse paths must equal.
REUSE_OFF = dict(prefix_cache_entries=0, active_prefix_reuse_min_tokens=0)
# The daemon's own prefill chunk: each of a test's prompts prefills in one step (real_engine's is 16).
WHOLE_PROMPTS = dict(prefill_chunk=EngineConfig().prefill_chunk)


async def start_engine(backend: Backend, model_path: str = "scripted", dtype: str | None = None, plans=None,
                       drafts=None, **config) -> Engine:
    """`plans`: handed each step's plan; `drafts`: the drafter (Engine)."""
    engine = Engine(backend, model_path, dtype, EngineConfig(**{**TEST_CONFIG, **config}), Registry(), plans=plans,
                    drafts=drafts)
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
    return engine.stats().cached + engine.stats().named_holding


async def settled(engine: Engine, backend, extra: int = 0) -> None:
    """Wait until the runner has released what the engine let go of (releases are asynchronous):
    the backend then holds exactly the stored sessions, plus `extra` still in use."""
    await until(lambda: backend.live_sessions() == stored_sessions(engine) + extra)


def gated(name: str) -> Backend:
    """The real backend `name`, able to hold the runner inside a chosen prefill or decode (set
    `backend.gates["prefill" | "decode"] = Gate(...)`) while a test arranges the loop."""
    from scripted_backend import Gate

    module, cls = BACKENDS[name].split(":")
    base = getattr(importlib.import_module(module), cls)

    class Gated(base):
        def __init__(self) -> None:
            super().__init__()
            self.gates: dict[str, Gate] = {}

        def _hold(self, kind: str, sessions, inputs) -> None:
            gate = self.gates.get(kind)
            if gate is not None and gate.when(sessions, inputs):
                del self.gates[kind]
                gate.wait_here()

        def prefill(self, sessions, chunks):
            self._hold("prefill", sessions, chunks)
            return super().prefill(sessions, chunks)

        def decode(self, sessions, tokens):
            self._hold("decode", sessions, tokens)
            return super().decode(sessions, tokens)

    return Gated()


async def real_engine(backend: str | Backend, folder: str, **config) -> Engine:
    """An engine in float32 on a real backend (a name: gated, see `gated`) and a tiny model folder."""
    return await start_engine(gated(backend) if isinstance(backend, str) else backend, folder, "float32",
                              **{"prefill_chunk": 16, **config})


async def references(backend: str | Backend, folder: str, prompts, max_tokens: int, ignore_eos: bool = False,
                     **config) -> list[list[int]]:
    """Each prompt's greedy tokens with reuse off, one after the other."""
    engine = await real_engine(backend, folder, **{**config, **REUSE_OFF})
    out = [(await run(engine, p, max_tokens, ignore_eos=ignore_eos))[0] for p in prompts]
    await engine.shutdown(1)
    return out


async def drafted_plans(backend: Backend, folder: str, prompts: Sequence[Sequence[int]],
                        max_tokens: int = 20) -> tuple[list[StepPlan], list[int], list[list[int]]]:
    """The step plans of a run that drafts (scripted_drafts.ScriptedDrafts) on `backend` and a tiny model
    folder: each prompt run alone, then all at once, recorded: (the plans, the second run's request ids,
    each prompt's tokens), the two runs' tokens checked equal and some row checked to carry drafts. Skips
    where the backend cannot roll drafts back on this model (it never drafts there)."""
    plans: list[StepPlan] = []
    engine = await real_engine(backend, folder, plans=plans.append, drafts=ScriptedDrafts(), prefix_cache_entries=0)
    if not engine.backend.rolls_back:
        await engine.shutdown(1)
        pytest.skip(f"{type(backend).__name__} does not roll back (so does not draft) on {folder}")
    want = [(await run(engine, p, max_tokens, ignore_eos=True))[0] for p in prompts]
    handles = [engine.submit(request(p, max_tokens, rid=f"again{i}", ignore_eos=True)) for i, p in enumerate(prompts)]
    rids = [next(r.rid for r in engine.requests() if r.handle is h) for h in handles]
    assert [(await collect(h))[0] for h in handles] == want
    await engine.shutdown(1)
    assert any(row.reads > 1 for plan in plans for row in plan.decode)
    return plans, rids, want
