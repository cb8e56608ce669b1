"""Shutdown: stop admitting, let in-flight work finish within the grace, cancel the rest, release all."""

import asyncio

import pytest

from engine_harness import collect, prompt_of, reached, request, run, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.api import NotReady


async def test_in_flight_requests_finish_within_the_grace():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend)
    handles = [engine.submit(request(prompt_of(20, start=i), 10)) for i in range(3)]
    await engine.shutdown(grace_s=30)
    for i, handle in enumerate(handles):
        tokens, done = await collect(handle)
        assert done.finish_reason == "length" and tokens == backend.greedy(prompt_of(20, start=i), 10)
    assert backend.live_sessions() == 0 and not engine.runner_alive


async def test_shutdown_with_requests_in_every_phase():
    backend = ScriptedBackend()
    backend.delay["decode"] = backend.delay["prefill"] = 0.001
    engine = await start_engine(backend, inference_slots=3, prefill_chunk=4)
    await run(engine, prompt_of(30, start=300), 2, session_id="warm")  # a named session holding state
    await run(engine, prompt_of(30, start=200), 2)  # a prefix cache snapshot
    decoding = engine.submit(request(prompt_of(10, start=1), 100_000))
    while not (await decoding.__anext__()).token:
        pass
    prefilling = engine.submit(request(prompt_of(4000, start=2), 5))  # a thousand chunks
    named = engine.submit(request(prompt_of(3000, start=3), 5, session_id="busy"))
    queued = engine.submit(request(prompt_of(10, start=4), 5))
    gate = backend.gates["clone"] = Gate()  # the next capture holds the runner
    await engine.shutdown(grace_s=0.05)
    gate.open()
    for handle in (decoding, prefilling, named, queued):
        _, done = await collect(handle)
        assert done.finish_reason == "cancelled"
    assert backend.live_sessions() == 0 and backend.total_bytes() == 0
    assert not engine.runner_alive and not engine.ready
    with pytest.raises(NotReady):
        engine.submit(request(prompt_of(5), 1))


async def test_shutdown_while_the_runner_is_inside_a_capture():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    gate = backend.gates["clone"] = Gate()
    handle = engine.submit(request(prompt_of(40), 50))
    await reached(gate)
    closing = asyncio.create_task(engine.shutdown(grace_s=0.01))
    await until(lambda: all(r.ending == "cancelled" for r in engine.requests()))  # the grace has run out
    gate.open()
    await closing
    _, done = await collect(handle)
    assert done.finish_reason == "cancelled"
    assert backend.live_sessions() == 0


async def test_shutdown_twice_and_of_an_idle_engine():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    await engine.shutdown(1)
    await engine.shutdown(1)
    assert backend.live_sessions() == 0 and not engine.runner_alive
