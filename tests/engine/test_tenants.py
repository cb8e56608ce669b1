"""Isolation through the engine, on the scripted backend: a request reuses only its own scope's state
(the tenant whose key authenticated it, split by cache_salt): no cached prefix, donor, leader or named
session of another scope, so its timing shows a cold prompt."""

import asyncio

import pytest

from engine_harness import collect, prompt_of, request, run, settled, start_engine
from scripted_backend import ScriptedBackend
from kvfork.server.engine.api import Scope, TokenEvent

A, A_SALTED, B = Scope("tenant-a"), Scope("tenant-a", "salt"), Scope("tenant-b")
OTHERS = [pytest.param(B, id="other-tenant"), pytest.param(A_SALTED, id="other-salt")]


def clones_only_its_own(backend: ScriptedBackend, since: int) -> bool:
    """Every clone since call `since` copies a session opened since then (its own capture, its own
    follower's clone): none copies state that existed before, i.e. another request's."""
    calls = backend.calls[since:]
    own = {sid for c in calls if c[0] == "prefill" for sid, _ in c[1]}
    return all(c[1] in own for c in calls if c[0] == "clone")


@pytest.mark.parametrize("other", [pytest.param(A, id="same-scope"), *OTHERS])
async def test_the_prefix_cache_serves_only_its_own_scope(other):
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    prompt = prompt_of(40)
    await run(engine, prompt, 4, scope=A)
    since = len(backend.calls)
    tokens, done = await run(engine, prompt, 4, scope=other)
    assert tokens == backend.greedy(prompt, 4)
    if other == A:  # the control: the same scope is served warm
        assert (done.usage.reuse_source, done.usage.reused_tokens) == ("cache", 39)
    else:
        assert (done.usage.reuse_source, done.usage.reused_tokens, done.usage.prefilled_tokens) == (None, 0, 40)
        assert clones_only_its_own(backend, since)
        assert engine.stats().cached == 2  # one entry per scope, the same tokens
    await engine.shutdown(1)


S, T = 200, 5
SHARED = prompt_of(S, start=3)
LEADER, LATER = SHARED + [10] * T, SHARED + [11] * T


@pytest.mark.parametrize("other", [pytest.param(A, id="same-scope"), *OTHERS])
async def test_a_burst_follows_only_a_leader_of_its_own_scope(other):
    backend = ScriptedBackend()
    backend.delay["prefill"] = 0.005  # a model-like prefill rate: following pays
    engine = await start_engine(backend, active_prefix_reuse_min_tokens=8, prefix_cache_entries=0, prefill_chunk=32)
    lead = engine.submit(request(LEADER, 4, rid="lead", scope=A))
    since = len(backend.calls)
    later = engine.submit(request(LATER, 4, rid="later", scope=other))
    (_, _), (tokens, done) = await asyncio.gather(collect(lead), collect(later))
    assert tokens == backend.greedy(LATER, 4)
    if other == A:
        assert (done.usage.reuse_source, done.usage.reused_tokens) == ("donor", S)
    else:
        assert (done.usage.reuse_source, done.usage.reused_tokens, done.usage.prefilled_tokens) == (None, 0, S + T)
        assert engine.metrics.follow.get(choice="follow") == 0
        assert clones_only_its_own(backend, since)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


@pytest.mark.parametrize("other", [pytest.param(A, id="same-scope"), *OTHERS])
async def test_a_decoding_donor_gives_only_to_its_own_scope(other):
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend, active_prefix_reuse_min_tokens=8, follow=False, prefix_cache_entries=0,
                                prefill_chunk=16)
    donor = engine.submit(request(LEADER, 10_000, rid="donor", scope=A))
    assert isinstance(await asyncio.wait_for(donor.__anext__(), 10), TokenEvent)  # it decodes now
    since = len(backend.calls)
    tokens, done = await run(engine, LATER, 6, scope=other)
    assert tokens == backend.greedy(LATER, 6)
    if other == A:
        assert (done.usage.reuse_source, done.usage.reused_tokens) == ("donor", S)
    else:
        assert (done.usage.reuse_source, done.usage.reused_tokens) == (None, 0)
        assert clones_only_its_own(backend, since)
    donor.cancel()
    await collect(donor)
    await engine.shutdown(1)


async def test_a_session_id_names_a_session_per_tenant():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    first = prompt_of(30)
    out, _ = await run(engine, first, 4, session_id="chat", scope=A)
    follow_up = first + out + prompt_of(6, start=77)
    # tenant b's "chat" is another session: it starts cold, and leaves a's state alone
    tokens, done = await run(engine, follow_up, 4, session_id="chat", scope=B)
    assert tokens == backend.greedy(follow_up, 4) and done.usage.reused_tokens == 0
    assert engine.serving.named.get("chat", "tenant-a").state is not None
    assert engine.reset_session("chat", "tenant-b") and engine.delete_session("chat", "tenant-b")
    assert not engine.reset_session("chat", "tenant-b")
    _, warm = await run(engine, follow_up, 4, session_id="chat", scope=A)  # a's is still warm
    assert (warm.usage.reuse_source, warm.usage.reused_tokens) == ("session", 33)
    await engine.shutdown(1)


async def test_a_session_resumes_only_under_the_salt_that_computed_it():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    first = prompt_of(30)
    out, _ = await run(engine, first, 4, session_id="chat", scope=A)
    follow_up = first + out + prompt_of(6, start=77)
    tokens, done = await run(engine, follow_up, 4, session_id="chat", scope=A_SALTED)
    assert tokens == backend.greedy(follow_up, 4) and done.usage.reused_tokens == 0
    await settled(engine, backend)
    assert backend.live_sessions() == 1  # a's state was released when the salted request restarted it
    await engine.shutdown(1)
