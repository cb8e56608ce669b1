"""Active prefix reuse (clone-now, --no-follow) through the engine, on the scripted backend."""

import asyncio
import random
import time

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.request import Prefilling
from kvfork.server.engine.api import TokenEvent

SHARED = prompt_of(60, start=11)
DONOR = SHARED + [7, 7, 7, 7, 7]
RECIPIENT = SHARED + [9, 9, 9, 9, 9, 9]
CLONE_NOW = dict(active_prefix_reuse_min_tokens=8, follow=False, prefix_cache_entries=0, prefill_chunk=16)
# A donor whose clone a test gates must still be running when the recipient is planned. Undelayed, a
# donor decodes its whole context (4,031 tokens) in about a second; on a loaded machine the control
# loop took longer than that to plan the recipient, found no donor, and no clone ever reached the gate.
DONOR_STEP_S = 0.01


async def first_token(handle) -> int:
    event = await asyncio.wait_for(handle.__anext__(), 10)
    assert isinstance(event, TokenEvent)
    return event.token


async def test_a_recipient_clones_what_a_decoding_donor_committed():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 40))
    head = [await first_token(donor)]
    tokens, done = await run(engine, RECIPIENT, 12)
    assert tokens == backend.greedy(RECIPIENT, 12)
    u = done.usage
    assert (u.reuse_source, u.reused_tokens, u.prefilled_tokens) == ("donor", 60, 6)
    rest, donor_done = await collect(donor)
    assert head + rest == backend.greedy(DONOR, 40) and donor_done.finish_reason == "length"
    m = engine.metrics
    assert m.clone_successes.get(source="donor") == 1 and m.reused_tokens.get(source="donor") == 60
    assert m.donor_saved.get() == 60
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_a_recipient_prefills_its_tail_in_the_very_next_step():
    # The clone and the start are one runner command: no step goes by while the
    # control loop answers a clone with a start.
    backend = ScriptedBackend()
    backend.delay["decode"] = DONOR_STEP_S
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 10_000))
    await first_token(donor)
    gate = backend.gates["decode"] = Gate()  # the runner is inside a step's decode
    await reached(gate)
    recipient = engine.submit(request(RECIPIENT, 3))
    # admitted at once: its Start (the donor clone with it) went to the runner before the step ends
    assert [type(r.phase) for r in engine.requests() if r.prompt == RECIPIENT] == [Prefilling]
    held = len(backend.calls)
    gate.open()
    tokens, done = await collect(recipient)
    assert tokens == backend.greedy(RECIPIENT, 3) and done.usage.reuse_source == "donor"
    after = backend.calls[held:]
    tail = next(i for i, call in enumerate(after) if call[0] == "prefill")
    assert [call[0] for call in after[:tail]] == ["clone", "decode"]  # the next step's decode, then its prefill
    donor.cancel()
    await collect(donor)
    await engine.shutdown(1)


async def test_named_session_recipients_keep_their_own_path():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 10_000))
    await first_token(donor)
    tokens, done = await run(engine, RECIPIENT, 5, session_id="mine")
    assert tokens == backend.greedy(RECIPIENT, 5) and done.usage.reused_tokens == 0
    donor.cancel()
    await collect(donor)
    await engine.shutdown(1)


async def test_the_minimum_is_measured_against_the_cached_match():
    # a snapshot matches 30; the donor (which started from it) has committed 46: active reuse saves 16 more
    for min_tokens, source, reused in ((16, "donor", 46), (17, "cache", 30)):
        backend = ScriptedBackend()
        engine = await start_engine(backend, **{**CLONE_NOW, "prefix_cache_entries": 16,
                                                "active_prefix_reuse_min_tokens": min_tokens})
        await run(engine, SHARED[:30] + [5, 5], 2)
        gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 46)
        donor = engine.submit(request(DONOR, 3))
        await reached(gate)
        recipient = engine.submit(request(RECIPIENT, 6))
        gate.open()
        tokens, done = await collect(recipient)
        assert tokens == backend.greedy(RECIPIENT, 6)
        assert (done.usage.reuse_source, done.usage.reused_tokens) == (source, reused)
        assert (await collect(donor))[0] == backend.greedy(DONOR, 3)
        await engine.shutdown(1)


async def test_a_donor_that_finished_before_the_clone_ran_serves_through_its_capture():
    backend = ScriptedBackend()
    engine = await start_engine(backend, **{**CLONE_NOW, "prefix_cache_entries": 16})
    # hold the runner inside the donor's last prefill chunk: the loop saw it at 64 of 65
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    donor = engine.submit(request(DONOR, 1))
    await reached(gate)
    recipient = engine.submit(request(RECIPIENT, 6))  # clone of 60 ordered; the donor finishes first
    gate.open()
    (_, donor_done), (tokens, done) = await asyncio.gather(collect(donor), collect(recipient))
    assert donor_done.finish_reason == "length"
    assert tokens == backend.greedy(RECIPIENT, 6)
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("cache", 60)
    assert engine.metrics.clone_refusals.get(source="donor", reason="donor_gone") == 1
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_a_donor_cancelled_while_the_clone_is_queued():
    backend = ScriptedBackend()
    backend.delay["decode"] = DONOR_STEP_S
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 10_000))
    await first_token(donor)
    gate = backend.gates["decode"] = Gate()
    await reached(gate)
    recipient = engine.submit(request(RECIPIENT, 6))
    donor.cancel()  # queued behind the clone order: the clone still takes the committed state
    gate.open()
    (_, donor_done), (tokens, done) = await asyncio.gather(collect(donor), collect(recipient))
    assert donor_done.finish_reason == "cancelled"
    assert tokens == backend.greedy(RECIPIENT, 6) and done.usage.reuse_source == "donor"
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_an_overwritten_sliding_window_falls_back_to_a_full_prefill():
    backend = ScriptedBackend(window=8)
    engine = await start_engine(backend, **CLONE_NOW)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 32)
    donor = engine.submit(request(DONOR, 4))
    await reached(gate)  # the loop saw 32 committed; the donor is writing 32..48
    recipient = engine.submit(request(RECIPIENT, 6))
    gate.open()
    tokens, done = await collect(recipient)
    assert tokens == backend.greedy(RECIPIENT, 6)
    assert (done.usage.reused_tokens, done.usage.prefilled_tokens) == (0, 66)
    assert engine.metrics.clone_refusals.get(source="donor", reason="window_overwritten") == 1
    assert (await collect(donor))[0] == backend.greedy(DONOR, 4)
    await engine.shutdown(1)


async def test_a_refused_clone_takes_the_normal_path():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    backend.refuse = lambda session, upto: "no_memory"
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 10_000))
    await first_token(donor)
    tokens, done = await run(engine, RECIPIENT, 6)
    assert tokens == backend.greedy(RECIPIENT, 6) and done.usage.reused_tokens == 0
    assert engine.metrics.clone_refusals.get(source="donor", reason="no_memory") == 1
    donor.cancel()
    await collect(donor)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_a_recipient_cancelled_while_its_clone_is_pending_leaks_nothing():
    backend = ScriptedBackend()
    backend.delay["decode"] = DONOR_STEP_S
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 10_000))
    await first_token(donor)
    gate = backend.gates["clone"] = Gate()
    recipient = engine.submit(request(RECIPIENT, 6))
    await reached(gate)
    recipient.cancel()  # the runner holds its Start (the clone is part of it): it ends it before any step
    gate.open()
    tokens, done = await collect(recipient)
    assert done.finish_reason == "cancelled" and tokens == []
    assert engine.snapshot().slots_used == 1  # its slot went back with it
    donor.cancel()
    await collect(donor)
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.snapshot().reserved == 0
    await engine.shutdown(1)


async def test_shutdown_with_a_clone_pending():
    backend = ScriptedBackend()
    backend.delay["decode"] = DONOR_STEP_S
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 10_000))
    await first_token(donor)
    gate = backend.gates["clone"] = Gate()
    recipient = engine.submit(request(RECIPIENT, 6))
    await reached(gate)
    closing = asyncio.create_task(engine.shutdown(grace_s=0.01))
    # the clone outlasts the grace period: shutdown cancels both, then the clone comes back
    await until(lambda: all(r.ending == "cancelled" for r in engine.requests()))
    gate.open()
    assert (await collect(recipient))[1].finish_reason == "cancelled"
    await closing
    assert (await collect(donor))[1].finish_reason == "cancelled"
    assert backend.live_sessions() == 0 and not engine.runner_alive


async def test_races_repeated():
    """Donors and recipients with random timing and random cancellations: every finished stream is exact,
    and nothing leaks. Repeated, time-boxed."""
    rng = random.Random(5)
    deadline = time.monotonic() + 20
    for repeat in range(25):
        if time.monotonic() > deadline:
            break
        backend = ScriptedBackend(window=rng.choice([None, 8]))
        backend.delay = {"decode": rng.choice([0, 0.0005]), "prefill": rng.choice([0, 0.001]),
                         "clone": rng.choice([0, 0.001])}
        engine = await start_engine(backend, **{**CLONE_NOW, "inference_slots": rng.choice([2, 4, 8]),
                                                "prefix_cache_entries": rng.choice([0, 4])})
        shared = prompt_of(rng.randint(20, 80), start=repeat)
        prompts = [shared + prompt_of(rng.randint(1, 8), start=100 + i) for i in range(6)]
        handles = []
        for p in prompts:
            handles.append(engine.submit(request(p, rng.randint(1, 20))))
            await asyncio.sleep(rng.choice([0, 0.0005, 0.002]))
            if rng.random() < 0.3:
                rng.choice(handles).cancel()
        for p, h in zip(prompts, handles):
            tokens, done = await collect(h)
            if done.finish_reason == "length":
                assert tokens == backend.greedy(p, len(tokens)), (repeat, done.usage)
            else:
                assert done.finish_reason == "cancelled"
                assert tokens == backend.greedy(p, len(tokens))
        await settled(engine, backend)
        assert engine.snapshot().slots_used == 0 and engine.snapshot().reserved == 0
        await engine.shutdown(1)
        assert backend.live_sessions() == 0


async def test_a_pending_clone_is_in_flight_work_that_shutdown_lets_finish():
    backend = ScriptedBackend()
    backend.delay["decode"] = DONOR_STEP_S
    engine = await start_engine(backend, **CLONE_NOW)
    donor = engine.submit(request(DONOR, 200))
    await first_token(donor)
    gate = backend.gates["clone"] = Gate()
    recipient = engine.submit(request(RECIPIENT, 6))
    await reached(gate)
    closing = asyncio.create_task(engine.shutdown(grace_s=30))
    await asyncio.sleep(0.01)
    gate.open()
    tokens, done = await collect(recipient)
    assert done.finish_reason == "length" and tokens == backend.greedy(RECIPIENT, 6)
    assert done.usage.reuse_source == "donor"
    await closing
    assert (await collect(donor))[1].finish_reason == "length"
    assert backend.live_sessions() == 0
