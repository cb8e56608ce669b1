"""Named sessions through the engine: warm resume, busy, LRU cap, reset and delete."""

import pytest

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine, stored_sessions, until
from scripted_backend import Gate, ReadsImages, ScriptedBackend
from kvfork.backends.vision import ImageInput
from kvfork.backends.vision.keys import image_keys
from kvfork.server.engine.api import SessionBusy


async def test_warm_resume_prefills_only_the_new_tokens_and_equals_a_cold_run():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    first = prompt_of(30)
    out1, done1 = await run(engine, first, 6, session_id="chat")
    assert done1.usage.reuse_source is None and done1.usage.prefilled_tokens == 30
    follow_up = first + out1 + prompt_of(9, start=77)
    warm, done = await run(engine, follow_up, 8, session_id="chat")
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("session", 30 + 6 - 1)  # the last token never ran
    assert done.usage.prefilled_tokens == len(follow_up) - 35
    cold, cold_done = await run(engine, follow_up, 8)
    assert warm == cold and cold_done.usage.reused_tokens == 0
    await engine.shutdown(1)


async def test_a_prompt_that_does_not_extend_the_session_restarts_cold():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    await run(engine, prompt_of(30), 4, session_id="chat")
    other = prompt_of(25, start=9)
    tokens, done = await run(engine, other, 4, session_id="chat")
    assert tokens == backend.greedy(other, 4)
    assert done.usage.reused_tokens == 0 and done.usage.prefilled_tokens == 25
    await settled(engine, backend)
    assert backend.live_sessions() == 1  # the old state was released, the new one kept
    await engine.shutdown(1)


async def test_a_busy_session_runs_a_second_request_without_it_and_is_freed_when_its_request_ends():
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend, active_prefix_reuse_min_tokens=1, prefix_cache_entries=0)
    prompt = prompt_of(80)
    handle = engine.submit(request(prompt, 10_000, session_id="s"))
    await until(lambda: engine.request(1) is not None and engine.request(1).committed >= len(prompt))
    # the second runs at once, as an anonymous request: it clones the running one's prompt
    tokens, done = await run(engine, prompt + [7], 3, session_id="s")
    assert tokens == backend.greedy(prompt + [7], 3)
    assert done.usage.reuse_source == "donor" and done.usage.reused_tokens == len(prompt)
    assert engine.serving.named.get("s").busy  # still the first request's
    with pytest.raises(SessionBusy):
        engine.reset_session("s")
    handle.cancel()
    await collect(handle)
    tokens, done = await run(engine, prompt_of(10), 2, session_id="s")
    assert done.finish_reason == "length"
    await engine.shutdown(1)


async def test_session_cap_evicts_the_least_recently_used():
    backend = ScriptedBackend()
    engine = await start_engine(backend, max_named_sessions=2, prefix_cache_entries=0)
    for name in ("a", "b", "c"):
        await run(engine, prompt_of(10), 2, session_id=name)
    assert engine.serving.named.get("a") is None and engine.stats().named_sessions == 2
    await settled(engine, backend)
    assert backend.live_sessions() == 2
    await engine.shutdown(1)
    assert backend.live_sessions() == 0


async def test_reset_and_delete():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    prompt = prompt_of(20)
    out, _ = await run(engine, prompt, 3, session_id="s")
    assert engine.reset_session("s") is True
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.serving.named.get("s") is not None
    _, done = await run(engine, prompt + out + [5], 3, session_id="s")
    assert done.usage.reused_tokens == 0  # reset: nothing to resume
    assert engine.delete_session("s") is True
    assert engine.delete_session("s") is False and engine.reset_session("nope") is False
    await settled(engine, backend)
    assert backend.live_sessions() == stored_sessions(engine) == 0
    await engine.shutdown(1)


def test_the_cap_is_per_tenant_and_a_tenant_whose_sessions_are_all_busy_runs_without_one():
    """Issue 22: one tenant's sessions never evict another's; issue 23: a busy cap never refuses."""
    from kvfork.server.engine.cache.index import Index
    from kvfork.server.engine.cache.sessions import NamedSessions
    from test_index import FULL, KEY

    named = NamedSessions(2, Index(FULL, 0, None, 1, KEY))
    a1, _ = named.acquire("a1", "A")
    a2, _ = named.acquire("a2", "A")
    assert a1 is not None and a2 is not None
    assert named.acquire("a3", "A") == (None, ([], 0))  # both of A's busy: it runs without a session
    b1, _ = named.acquire("b1", "B")  # B's share is its own
    assert b1 is not None
    named.give_back(a1)
    a3, _ = named.acquire("a3", "A")  # A's new session evicts A's idle one, never B's
    assert a3 is not None and named.get("a1", "A") is None and named.get("b1", "B") is b1


async def test_a_named_session_stopped_inside_an_image_resumes_from_the_images_first_token():
    backend = ReadsImages()
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position > 0)  # its second chunk
    engine = await start_engine(backend, prefill_chunk=8, prefix_cache_entries=0)
    prompt = prompt_of(4) + image_keys(0x1234, 40) + prompt_of(5, start=9)
    images = (ImageInput(0x1234, 4, 44, 40),)
    handle = engine.submit(request(prompt, 4, session_id="s", images=images))
    await reached(gate)
    handle.cancel()
    gate.open()
    await collect(handle)
    await until(lambda: not engine.serving.named.get("s").busy)
    assert engine.serving.named.get("s").state.tokens == tuple(prompt[:4])  # it stopped at 16, inside the image
    warm, _ = await run(engine, prompt, 4, session_id="s", images=images)
    cold, _ = await run(engine, prompt, 4, images=images)
    assert warm == cold
    await settled(engine, backend, extra=0)
    await engine.shutdown(1)
