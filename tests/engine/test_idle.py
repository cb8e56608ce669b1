"""An idle runner gives malloc's free pages back to the system (device_memory.give_back_free_heap): once it has
had nothing to do for IDLE_SECONDS, once per idle spell, and not while a step holds it."""

import asyncio

from engine_harness import collect, prompt_of, reached, request, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.worker import runner


async def test_the_runner_gives_the_free_heap_back_once_per_idle_spell(monkeypatch):
    given: list[str] = []
    backend = ScriptedBackend()
    monkeypatch.setattr(runner, "give_back_free_heap", lambda: given.append("idle"))
    engine = await start_engine(backend)
    await until(lambda: given)  # idle since it loaded
    gate = backend.gates["decode"] = Gate()
    handle = engine.submit(request(prompt_of(20), 5))
    await reached(gate)  # the runner is inside a step
    await asyncio.sleep(2 * runner.IDLE_SECONDS)
    assert given == ["idle"]
    gate.open()
    tokens, done = await collect(handle)
    assert len(tokens) == 5
    await until(lambda: given == ["idle", "idle"])  # idle again
    await asyncio.sleep(2 * runner.IDLE_SECONDS)
    assert given == ["idle", "idle"]  # once, until work comes
    await engine.shutdown(grace_s=1)
