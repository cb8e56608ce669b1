"""Reuse through the engine, on the scripted backend: active prefix reuse (clone-now, --no-follow), then
the prefix cache's capture and lookup."""

import asyncio
import random
import time

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.api import TokenEvent
from kvfork.server.engine.loop.request import Prefilling


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
    assert engine.stats().slots_used == 1  # its slot went back with it
    donor.cancel()
    await collect(donor)
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
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
        assert engine.stats().slots_used == 0 and engine.stats().reserved == 0
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


def first_index(calls, match) -> int:
    return next(i for i, c in enumerate(calls) if match(c))


async def test_capture_runs_after_the_last_prefill_chunk_and_before_the_first_decode():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefill_chunk=16)
    prompt = prompt_of(40)
    await run(engine, prompt, 4)
    sid = backend.calls[0][1][0][0]
    last_chunk = max(i for i, c in enumerate(backend.calls) if c[0] == "prefill")
    capture = first_index(backend.calls, lambda c: c == ("clone", sid, 40))
    first_decode = first_index(backend.calls, lambda c: c[0] == "decode" and sid in c[1])
    assert last_chunk < capture < first_decode
    assert engine.stats().cached == 1
    await engine.shutdown(1)


async def test_a_sliding_window_snapshot_serves_the_same_prompt_again():
    # With a window of 8, a snapshot taken after the first decode could no longer give `prompt - 1`.
    backend = ScriptedBackend(window=8)
    engine = await start_engine(backend)
    prompt = prompt_of(40)
    cold, _ = await run(engine, prompt, 6)
    warm, done = await run(engine, prompt, 6)
    assert warm == cold == backend.greedy(prompt, 6)
    assert (done.usage.reused_tokens, done.usage.reuse_source, done.usage.prefilled_tokens) == (39, "cache", 1)
    await engine.shutdown(1)


async def test_capture_is_skipped_and_decode_goes_on_when_no_capture_is_free():
    backend = ScriptedBackend()
    gate = backend.gates["prefill"] = Gate()
    engine = await start_engine(backend, max_captures=1)
    a, b = prompt_of(30, start=1), prompt_of(30, start=2)
    ha = engine.submit(request(a, 5))
    hb = engine.submit(request(b, 5))
    await reached(gate)
    gate.open()
    (ta, _), (tb, _) = await asyncio.gather(collect(ha), collect(hb))
    assert ta == backend.greedy(a, 5) and tb == backend.greedy(b, 5)
    assert [c for c in backend.calls if c[0] == "clone"] == [("clone", backend.calls[0][1][0][0], 30)]
    assert engine.metrics.captures.get(outcome="skipped") == 1
    assert engine.metrics.captures.get(outcome="stored") == 1
    await engine.shutdown(1)


async def test_short_prompts_are_not_captured():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_min_tokens=20)
    await run(engine, prompt_of(19), 3)
    assert engine.stats().cached == 0 and backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_longest_cached_match_serves_and_entries_outlive_their_request():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    base = prompt_of(60)
    await run(engine, base[:30] + [9, 9, 9], 3)
    await run(engine, base[:50] + [8, 8], 3)
    assert backend.live_sessions() == 2  # both requests gone, their snapshots stay
    tokens, done = await run(engine, base + [5], 7)
    assert tokens == backend.greedy(base + [5], 7)
    assert (done.usage.reused_tokens, done.usage.reuse_source) == (50, "cache")
    admissions = engine.metrics.cache_admissions
    assert admissions.get(outcome="hit") == 2 and admissions.get(outcome="miss") == 1  # the second used the first
    await engine.shutdown(1)


async def test_a_refused_clone_falls_back_to_an_older_entry_then_to_a_full_prefill():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    base = prompt_of(60)
    await run(engine, base[:30] + [9, 9], 3)
    await run(engine, base[:50] + [8, 8], 3)
    longest = next(s for s in backend._open.values() if s.position == 52)
    backend.refuse = lambda session, upto: "no_memory" if session is longest else None
    tokens, done = await run(engine, base + [5], 7)
    assert tokens == backend.greedy(base + [5], 7)
    assert (done.usage.reused_tokens, done.usage.reuse_source) == (30, "cache")
    assert engine.metrics.clone_refusals.get(source="cache", reason="no_memory") == 1
    assert engine.stats().cached == 3  # the refused entry stays (and the new prompt was captured)

    backend.refuse = lambda session, upto: "no_memory"
    tokens, done = await run(engine, base + [6], 4)
    assert tokens == backend.greedy(base + [6], 4)
    assert (done.usage.reused_tokens, done.usage.reuse_source, done.usage.prefilled_tokens) == (0, None, 61)
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_cache_eviction_by_entries_releases_snapshots():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=2)
    for i in range(4):
        await run(engine, prompt_of(20, start=i * 50), 2)
    await settled(engine, backend)
    assert engine.stats().cached == 2 and backend.live_sessions() == 2
    await engine.shutdown(1)
    assert backend.live_sessions() == 0


async def test_metrics_report_the_cache_and_what_the_backend_holds_at_rest():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=1)
    await run(engine, prompt_of(20, start=1), 2)
    await run(engine, prompt_of(30, start=200), 2)  # its snapshot evicts the first one
    await until(lambda: engine.stats().live_sessions == 1)  # the eviction's release, reported at rest
    assert engine.stats().total_bytes == backend.total_bytes() == 30 * 1024
    text = engine.registry.render()
    for line in ("kvfork_prefix_cache_entries 1", f"kvfork_prefix_cache_bytes {30 * 1024}", "kvfork_live_sessions 1",
                 'kvfork_prefix_cache_captures_total{outcome="stored"} 2',
                 'kvfork_prefix_cache_admissions_total{outcome="miss"} 2',
                 "kvfork_prefilled_tokens_total 50", 'kvfork_requests_total{finish_reason="length"} 2',
                 # what the budget counts as held, against what the backend holds: the same at rest
                 f"kvfork_kv_budget_held_bytes {30 * 1024}", f"kvfork_kv_bytes {30 * 1024}",
                 "kvfork_kv_reserved_bytes 0", "kvfork_kv_budget_exceeded_total 0"):
        assert line in text.splitlines(), line
    await engine.shutdown(1)
