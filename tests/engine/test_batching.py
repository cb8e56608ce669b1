"""The engine on the scripted backend: batching, finishing, limits, errors."""

import asyncio

import pytest

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine
from scripted_backend import EOS, Gate, ScriptedBackend
from kvfork.server.engine.api import CapacityExhausted, ContextTooLong, InvalidRequest, NotReady


async def test_load_runs_on_the_runner_thread_and_concurrent_requests_decode_together():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    assert engine.ready and backend.loaded_on is not None and backend.loaded_on.name == "kvfork-runner"
    prompts = [prompt_of(20 + i, start=i) for i in range(4)]
    results = await asyncio.gather(*(run(engine, p, 12) for p in prompts))
    for p, (tokens, done) in zip(prompts, results):
        assert tokens == backend.greedy(p, 12)
        assert done.finish_reason == "length" and done.usage.generated_tokens == 12
        assert done.usage.prompt_tokens == len(p) == done.usage.prefilled_tokens
    assert max(len(c[1]) for c in backend.calls if c[0] == "decode") == 4  # one batched call for all four
    await engine.shutdown(1)


async def test_stop_token_eos_and_ignore_eos():
    prompt = prompt_of(12)
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    expected = backend.greedy(prompt, 6)
    tokens, done = await run(engine, prompt, 6, stop_token_ids=frozenset({expected[3]}))
    assert tokens == expected[:3] and done.finish_reason == "stop"
    await engine.shutdown(1)

    backend = ScriptedBackend(script=lambda seq: EOS if len(seq) == 15 else 7)
    engine = await start_engine(backend)
    tokens, done = await run(engine, prompt, 6)
    assert tokens == [7, 7, 7] and done.finish_reason == "stop"
    tokens, done = await run(engine, prompt, 6, ignore_eos=True)
    assert tokens == [7, 7, 7, EOS, 7, 7] and done.finish_reason == "length"
    await engine.shutdown(1)


async def test_finish_from_the_daemon_ends_as_stop():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.002
    engine = await start_engine(backend)
    handle = engine.submit(request(prompt_of(10), 10_000))
    seen = 0
    async for event in handle:
        if hasattr(event, "token"):
            seen += 1
            if seen == 3:
                handle.finish()
        else:
            assert event.finish_reason == "stop"
    assert seen == 3  # nothing streams after finish()
    await engine.shutdown(1)


async def test_requests_wait_for_a_slot_and_the_queue_is_bounded():
    backend = ScriptedBackend()
    gate = backend.gates["prefill"] = Gate()
    engine = await start_engine(backend, inference_slots=1, max_queue=1)
    first = engine.submit(request(prompt_of(10), 3))
    await reached(gate)
    second = engine.submit(request(prompt_of(11), 3))
    with pytest.raises(CapacityExhausted):
        engine.submit(request(prompt_of(12), 3))
    gate.open()
    assert (await collect(first))[1].finish_reason == "length"
    tokens, done = await collect(second)
    assert done.finish_reason == "length" and tokens == backend.greedy(prompt_of(11), 3)
    assert done.usage.queue_s > 0
    await engine.shutdown(1)


async def test_queue_timeout_ends_the_waiting_request_with_an_error():
    backend = ScriptedBackend()
    gate = backend.gates["prefill"] = Gate()
    engine = await start_engine(backend, inference_slots=1, queue_timeout=0.05)
    first = engine.submit(request(prompt_of(10), 3))
    await reached(gate)
    tokens, done = await collect(engine.submit(request(prompt_of(11), 3)))
    assert tokens == [] and done.finish_reason == "error" and "queue-timeout" in done.error
    gate.open()
    assert (await collect(first))[1].finish_reason == "length"
    await engine.shutdown(1)


async def test_bad_requests_are_refused_with_engine_errors():
    backend = ScriptedBackend(context_length=64)
    engine = await start_engine(backend, kv_budget_bytes=1024 * 100)
    with pytest.raises(ContextTooLong):
        engine.submit(request(prompt_of(64), 1))
    with pytest.raises(InvalidRequest):
        engine.submit(request([], 1))
    with pytest.raises(InvalidRequest):
        engine.submit(request(prompt_of(5), 1, session_id="bad\nname"))
    # max_tokens is clamped to the context: 60 + 4 tokens fill a 64-token context
    tokens, done = await run(engine, prompt_of(60), 100)
    assert len(tokens) == 4 and done.finish_reason == "length"
    await engine.shutdown(1)


async def test_a_request_that_could_never_fit_the_budget_is_refused_at_once():
    engine = await start_engine(ScriptedBackend(), kv_budget_bytes=1024 * 50)
    with pytest.raises(CapacityExhausted):
        engine.submit(request(prompt_of(40), 20))  # 60 tokens of 1 KiB each
    tokens, done = await run(engine, prompt_of(40), 5)
    assert done.finish_reason == "length"
    await engine.shutdown(1)


async def test_the_budget_makes_admission_wait_and_the_prefix_cache_gives_way():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    # 100 tokens of budget: one request of 40 + 20 at a time, and a capture of 40 evicted when needed
    engine = await start_engine(backend, kv_budget_bytes=1024 * 100, prefix_cache_min_tokens=8)
    results = await asyncio.gather(*(run(engine, prompt_of(40, start=i), 20) for i in range(3)))
    for i, (tokens, done) in enumerate(results):
        assert tokens == backend.greedy(prompt_of(40, start=i), 20)
    starts = [c for c in backend.calls if c[0] == "prefill"]
    assert all(len(c[1]) == 1 for c in starts)  # never two requests in at once: the budget held them apart
    assert backend.total_bytes() <= 1024 * 100
    await engine.shutdown(1)


async def test_a_failing_request_fails_alone():
    backend = ScriptedBackend()
    bad = prompt_of(10, start=99)
    backend.fail = lambda kind, sessions, chunks: kind == "prefill" and any(c[:1] == bad[:1] for c in chunks)
    engine = await start_engine(backend)
    good = prompt_of(10, start=1)
    (tokens_bad, done_bad), (tokens_good, done_good) = await asyncio.gather(run(engine, bad, 4), run(engine, good, 4))
    assert done_bad.finish_reason == "error" and tokens_bad == []
    assert done_good.finish_reason == "length" and tokens_good == backend.greedy(good, 4)
    await settled(engine, backend)
    assert backend.live_sessions() == 1  # the good prompt's snapshot
    await engine.shutdown(1)


async def test_submit_before_start_and_after_shutdown_is_not_ready():
    backend = ScriptedBackend()
    from kvfork.server.engine.config import EngineConfig
    from kvfork.server.engine.loop.engine import Engine
    from kvfork.server.watch.metrics import Registry
    engine = Engine(backend, "x", None, EngineConfig(), Registry())
    with pytest.raises(NotReady):
        engine.submit(request(prompt_of(4), 1))
    await engine.start()
    await engine.shutdown(1)
    with pytest.raises(NotReady):
        engine.submit(request(prompt_of(4), 1))


async def test_a_failed_load_raises_from_start():
    backend = ScriptedBackend()
    backend.fail = lambda kind, sessions, inputs: kind == "load"
    with pytest.raises(RuntimeError, match="load"):
        await start_engine(backend)
