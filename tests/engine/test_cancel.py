"""Cancellation in every phase: the request leaves, others are untouched, nothing leaks."""

import asyncio

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine
from scripted_backend import Gate, ScriptedBackend


async def baseline(engine, backend) -> tuple[int, int]:
    """A finished request leaves a snapshot: the state every test must come back to."""
    await run(engine, prompt_of(30, start=400), 2)
    return backend.live_sessions(), backend.total_bytes()


async def test_cancel_mid_prefill():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefill_chunk=8)
    base = await baseline(engine, backend)
    gate = backend.gates["prefill"] = Gate()
    handle = engine.submit(request(prompt_of(40), 5))
    await reached(gate)
    handle.cancel()
    gate.open()
    tokens, done = await collect(handle)
    assert done.finish_reason == "cancelled" and tokens == []
    assert done.usage.prefilled_tokens < 40
    await settled(engine, backend)
    assert (backend.live_sessions(), backend.total_bytes()) == base
    assert engine.stats().cached == 1 and engine.metrics.captures.get(outcome="stored") == 1
    await engine.shutdown(1)


async def test_cancel_mid_decode_leaves_the_other_request_untouched():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend)
    base = await baseline(engine, backend)
    a, b = prompt_of(5, start=1), prompt_of(6, start=2)  # too short to capture
    ha, hb = engine.submit(request(a, 10_000)), engine.submit(request(b, 40))
    got = []
    async for event in ha:
        if hasattr(event, "token"):
            got.append(event.token)
            if len(got) == 3:
                ha.cancel()
        else:
            assert event.finish_reason == "cancelled"
            assert event.usage.generated_tokens >= 3
    assert got == backend.greedy(a, 3)
    tokens, done = await collect(hb)
    assert tokens == backend.greedy(b, 40) and done.finish_reason == "length"
    await settled(engine, backend)
    assert (backend.live_sessions(), backend.total_bytes()) == base
    await engine.shutdown(1)


async def test_cancel_mid_capture_discards_the_snapshot():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    base = await baseline(engine, backend)
    gate = backend.gates["clone"] = Gate()
    handle = engine.submit(request(prompt_of(40), 5))
    await reached(gate)  # the runner is taking the snapshot
    handle.cancel()
    gate.open()
    tokens, done = await collect(handle)
    assert done.finish_reason == "cancelled" and tokens == []  # the first token sampled meanwhile is dropped
    assert engine.metrics.captures.get(outcome="discarded") == 1
    await settled(engine, backend)
    assert (backend.live_sessions(), backend.total_bytes()) == base
    assert engine.stats().captures_in_use == 0
    await engine.shutdown(1)


async def test_cancel_while_queued_and_the_slot_goes_to_the_next():
    backend = ScriptedBackend()
    gate = backend.gates["prefill"] = Gate()
    engine = await start_engine(backend, inference_slots=1)
    first = engine.submit(request(prompt_of(10), 3))
    await reached(gate)
    queued = engine.submit(request(prompt_of(11), 3))
    third = engine.submit(request(prompt_of(12), 3))
    queued.cancel()
    tokens, done = await collect(queued)
    assert done.finish_reason == "cancelled" and tokens == [] and done.usage.prefilled_tokens == 0
    gate.open()
    await collect(first)
    tokens, done = await collect(third)
    assert tokens == backend.greedy(prompt_of(12), 3)
    assert engine.stats().slots_used == 0 and engine.stats().reserved == 0
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_cancel_after_done_and_twice_is_harmless():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    handle = engine.submit(request(prompt_of(10), 3))
    await collect(handle)
    handle.cancel()
    handle.cancel()
    handle.finish()
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_cancel_storm_leaves_nothing_behind():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.0005
    engine = await start_engine(backend, inference_slots=4, prefill_chunk=16)
    handles = [engine.submit(request(prompt_of(20 + i, start=i), 50)) for i in range(12)]
    for i, handle in enumerate(handles):
        for _ in range(i % 4):
            await asyncio.sleep(0.001)
        handle.cancel()
    dones = [await collect(h) for h in handles]
    assert all(done.finish_reason in ("cancelled", "length") for _, done in dones)
    await settled(engine, backend)
    assert engine.stats().slots_used == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)
    assert backend.live_sessions() == 0
