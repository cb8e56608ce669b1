"""Following the leader through the engine, on the scripted backend: a burst prefills its shared prefix once."""

import asyncio

import pytest

from engine_harness import collect, prompt_of, reached, request, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.api import CapacityExhausted

S, T = 200, 5
SHARED = prompt_of(S, start=3)
PROMPTS = [SHARED + [10 + i] * T for i in range(6)]
FOLLOW = dict(active_prefix_reuse_min_tokens=8, prefix_cache_entries=0, prefill_chunk=32)


def slow_prefill(backend: ScriptedBackend) -> ScriptedBackend:
    """Prefill at a model-like rate (a few thousand tokens/s): with the scripted backend's instant prefill,
    the measured rates make cloning what is committed now always cheaper than waiting."""
    backend.delay["prefill"] = 0.005
    return backend


async def burst(engine, prompts=PROMPTS, max_tokens=4):
    handles = [engine.submit(request(p, max_tokens, rid=f"r{i}")) for i, p in enumerate(prompts)]
    return handles, await asyncio.gather(*(collect(h) for h in handles))


@pytest.mark.parametrize("window", [None, 16])
async def test_a_burst_of_six_prefills_the_shared_prefix_once(window):
    backend = ScriptedBackend(window=window)
    engine = await start_engine(backend, **FOLLOW)
    _, results = await burst(engine)
    for p, (tokens, done) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4) and done.finish_reason == "length"
    assert [done.usage.prefilled_tokens for _, done in results] == [S + T] + [T] * 5
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results[1:]] == [("donor", S)] * 5
    assert engine.metrics.prefilled_tokens.get() == S + 6 * T
    assert engine.metrics.follow.get(choice="follow") == 5
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_clone_now_alone_saves_little_in_a_burst():
    backend = ScriptedBackend()
    engine = await start_engine(backend, **FOLLOW, follow=False)
    _, results = await burst(engine)
    for p, (tokens, _) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4)
    assert engine.metrics.prefilled_tokens.get() == 6 * (S + T)  # nobody had committed anything yet
    await engine.shutdown(1)


async def test_followers_wait_without_a_slot_and_then_take_one():
    backend = ScriptedBackend()
    engine = await start_engine(backend, **FOLLOW, inference_slots=1)
    _, results = await burst(engine, PROMPTS[:4])
    for p, (tokens, _) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4)
    assert engine.metrics.prefilled_tokens.get() == S + 4 * T
    await engine.shutdown(1)


@pytest.mark.parametrize("cancel_at", [0, 64, 160, 192, "decoding"])
async def test_leader_cancelled_at_every_phase(cancel_at):
    backend = ScriptedBackend(window=16)
    engine = await start_engine(backend, **FOLLOW)
    if cancel_at == "decoding":
        gate = backend.gates["decode"] = Gate()
    else:
        gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == cancel_at)
    handles = [engine.submit(request(p, 4, rid=f"r{i}")) for i, p in enumerate(PROMPTS)]
    await reached(gate)
    handles[0].cancel()
    gate.open()
    results = await asyncio.gather(*(collect(h) for h in handles))
    leader_tokens, leader_done = results[0]
    assert leader_done.finish_reason == "cancelled"
    for p, (tokens, done) in zip(PROMPTS[1:], results[1:]):
        assert done.finish_reason == "length" and tokens == backend.greedy(p, 4)
    # nothing of the shared part was prefilled twice: beyond it, each request computed at most its own tail
    leader_prefilled = leader_done.usage.prefilled_tokens
    total = sum(done.usage.prefilled_tokens for _, done in results)
    assert total == S + 5 * T + max(0, leader_prefilled - S)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    assert engine.snapshot().slots_used == 0 and engine.snapshot().reserved == 0
    await engine.shutdown(1)


async def test_a_follower_past_its_wait_takes_the_seed_path():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW, follow_max_wait=0.2)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)  # the leader is stuck inside a chunk
    follower = engine.submit(request(PROMPTS[1], 4))
    assert engine.snapshot().following
    await asyncio.sleep(0.3)  # past its follow deadline: it stops following, nothing waits forever
    assert not engine.snapshot().following
    gate.open()
    tokens, done = await collect(follower)
    assert tokens == backend.greedy(PROMPTS[1], 4)
    assert done.usage.reuse_source == "donor" and done.usage.reused_tokens == 64  # what was committed then
    assert engine.metrics.follow.get(choice="follow") == 1  # it did follow first
    await collect(leader)
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_a_follower_whose_leader_slows_down_goes_on_following_while_that_is_cheaper():
    """Issue 23: on a loaded machine followers waited out --follow-max-wait, cloned half the prefix
    and prefilled the rest, answering after reuse off. At the deadline the costs are compared with
    the leader's measured progress: it is still moving, so the follower keeps following."""
    backend = ScriptedBackend()
    backend.delay["prefill"] = 0.002
    engine = await start_engine(backend, **FOLLOW, follow_max_wait=0.5)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)
    follower = engine.submit(request(PROMPTS[1], 4))
    assert engine.snapshot().following  # the measured rate puts the leader's target well within the wait
    backend.delay["prefill"] = 0.3  # the machine slows down: the rest (5 chunks) takes three times the wait
    gate.open()
    tokens, done = await collect(follower)
    assert tokens == backend.greedy(PROMPTS[1], 4)
    assert done.usage.reuse_source == "donor" and done.usage.reused_tokens == S  # all of the shared prefix
    await collect(leader)
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_a_follower_cancelled_while_parked_leaves_nothing():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)
    follower = engine.submit(request(PROMPTS[1], 4))
    behind = engine.submit(request(PROMPTS[2], 4))
    follower.cancel()
    assert (await collect(follower))[1].finish_reason == "cancelled"
    gate.open()
    tokens, done = await collect(behind)
    assert tokens == backend.greedy(PROMPTS[2], 4) and done.usage.reused_tokens == S
    assert (await collect(leader))[0] == backend.greedy(PROMPTS[0], 4)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_shutdown_with_followers_parked():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    handles = [engine.submit(request(p, 4)) for p in PROMPTS]
    await reached(gate)
    closing = asyncio.create_task(engine.shutdown(grace_s=0.01))
    await until(lambda: all(r.ending == "cancelled" for r in engine.requests()))  # the grace has run out
    gate.open()
    await closing
    for h in handles:
        assert (await collect(h))[1].finish_reason == "cancelled"
    assert backend.live_sessions() == 0


async def test_races_repeated():
    """Bursts with random timing, cancellations and windows: every stream exact, nothing leaks. Time-boxed."""
    import random
    import time
    rng = random.Random(9)
    deadline = time.monotonic() + 20
    for repeat in range(25):
        if time.monotonic() > deadline:
            break
        backend = ScriptedBackend(window=rng.choice([None, 16]))
        backend.delay = {"prefill": rng.choice([0, 0.001]), "decode": rng.choice([0, 0.0005]),
                         "clone": rng.choice([0, 0.001])}
        engine = await start_engine(backend, **{**FOLLOW, "inference_slots": rng.choice([1, 3, 8]),
                                                "prefill_chunk": rng.choice([16, 32, 64])})
        shared = prompt_of(rng.randint(40, 160), start=repeat)
        prompts = [shared[:rng.randint(len(shared) // 2, len(shared))] + prompt_of(rng.randint(1, 6), start=50 + i)
                   for i in range(6)]
        handles = []
        for p in prompts:
            handles.append(engine.submit(request(p, rng.randint(1, 8))))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.choice([0, 0.001, 0.003]))
            if rng.random() < 0.25:
                rng.choice(handles).cancel()
        for p, h in zip(prompts, handles):
            tokens, done = await collect(h)
            assert done.finish_reason in ("length", "cancelled"), (repeat, done)
            assert tokens == backend.greedy(p, len(tokens)), (repeat, done.usage)
        await settled(engine, backend)
        assert engine.snapshot().slots_used == 0 and engine.snapshot().reserved == 0
        assert not engine.snapshot().following
        await engine.shutdown(1)
        assert backend.live_sessions() == 0


async def test_followers_count_against_the_queue_and_its_timeout():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW, inference_slots=1, max_queue=1, queue_timeout=0.2)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)
    follower = engine.submit(request(PROMPTS[1], 4))
    assert engine.snapshot().following  # parked, holding no slot
    with pytest.raises(CapacityExhausted):
        engine.submit(request(PROMPTS[2], 4))  # the slot is taken and the follower fills the queue
    tokens, done = await collect(follower)  # the leader is stuck past the queue timeout
    assert done.finish_reason == "error" and "queue-timeout" in done.error and tokens == []
    gate.open()
    assert (await collect(leader))[0] == backend.greedy(PROMPTS[0], 4)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_cache_entries_on_a_sliding_model_never_block_following():
    """A cached prompt longer than the window serves only a clone at its end (matching.window_floor): an
    entry that shares the burst's 200 tokens must not report a match the backend will refuse."""
    backend = slow_prefill(ScriptedBackend(window=16))
    engine = await start_engine(backend, **{**FOLLOW, "prefix_cache_entries": 16})
    tokens, _ = await collect(engine.submit(request(PROMPTS[5], 4)))
    assert engine.snapshot().cached == 1  # SHARED + 5 tokens, longer than the window
    _, results = await burst(engine, PROMPTS[:4])
    for p, (tokens, done) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4) and done.finish_reason == "length"
    assert [done.usage.reused_tokens for _, done in results] == [0, S, S, S]
    await engine.shutdown(1)
