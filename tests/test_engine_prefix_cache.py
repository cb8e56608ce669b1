"""Capture and lookup through the engine, on the scripted backend."""

import asyncio

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend


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
    assert engine.snapshot().cached == 1
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
    assert engine.snapshot().cached == 0 and backend.live_sessions() == 0
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
    assert engine.snapshot().cached == 3  # the refused entry stays (and the new prompt was captured)

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
    assert engine.snapshot().cached == 2 and backend.live_sessions() == 2
    await engine.shutdown(1)
    assert backend.live_sessions() == 0


async def test_metrics_report_the_cache_and_what_the_backend_holds_at_rest():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=1)
    await run(engine, prompt_of(20, start=1), 2)
    await run(engine, prompt_of(30, start=200), 2)  # its snapshot evicts the first one
    await until(lambda: engine.stats.live_sessions == 1)  # the eviction's release, reported at rest
    assert engine.stats.total_bytes == backend.total_bytes() == 30 * 1024
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
