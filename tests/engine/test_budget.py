"""The KV budget on the scripted backend (1 KiB per token, priced exactly): everything the backend holds
was reserved before it existed, and what the budget holds never blocks admission for good."""

import asyncio

import pytest

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine, until
from scripted_backend import BYTES_PER_TOKEN as KIB, Gate, ReadsImages, ScriptedBackend
from kvfork.backends.vision import ImageInput
from kvfork.backends.vision.keys import image_keys
from kvfork.server.engine.api import CapacityExhausted
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.loop.request import Following, Prefilling, Queued

S, T = 200, 5
SHARED = prompt_of(S, start=3)
FOLLOW = dict(active_prefix_reuse_min_tokens=8, prefix_cache_entries=0, prefill_chunk=32)


class Watched(ScriptedBackend):
    """Records the most bytes it ever held, after every call that can allocate."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.delay["prefill"] = 0.005  # a model-like prefill rate, so following pays
        self.peak = 0

    def _watch(self, out):
        self.peak = max(self.peak, self.total_bytes())
        return out

    def prefill(self, sessions, chunks):
        return self._watch(super().prefill(sessions, chunks))

    def decode(self, sessions, tokens):
        return self._watch(super().decode(sessions, tokens))

    def clone(self, session, upto):
        return self._watch(super().clone(session, upto))


async def test_idle_named_sessions_give_way_and_their_owners_start_cold():
    backend = ScriptedBackend()
    # 100 tokens of budget; each request grows to 30 + 10 tokens
    engine = await start_engine(backend, kv_budget_bytes=100 * KIB, prefix_cache_entries=0, queue_timeout=30)
    a, b = prompt_of(30, start=1), prompt_of(30, start=2)
    for name, p in (("a", a), ("b", b)):
        tokens, done = await run(engine, p, 10, session_id=name)
        assert done.finish_reason == "length"
    assert engine.stats().held == 2 * 39 * KIB  # both idle, 39 tokens committed each
    # a newcomer needs 40 of the 22 left: the least recently used idle session gives way, at once
    tokens, done = await run(engine, prompt_of(30, start=3), 10)
    assert done.finish_reason == "length" and done.usage.queue_s < 30
    assert engine.serving.named.get("a").state is None and engine.serving.named.get("b").state is not None
    # a's owner gets a cold start, never an error; b resumes warm
    tokens, done = await run(engine, a + [7], 4, session_id="a")
    assert done.finish_reason == "length" and done.usage.reused_tokens == 0
    assert tokens == backend.greedy(a + [7], 4)
    await settled(engine, backend)
    assert engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


async def test_parked_followers_count_against_max_queue():
    backend = Watched()
    engine = await start_engine(backend, **FOLLOW, inference_slots=2, max_queue=1)
    prompts = [SHARED + [10 + i] * T for i in range(6)]
    handles, refused = [], 0
    for i, p in enumerate(prompts):
        try:
            handles.append(engine.submit(request(p, 4, rid=f"r{i}")))
        except CapacityExhausted:
            refused += 1
        assert engine.waiting() <= 1
    assert engine.stats().following == 1 and refused == 4  # the leader runs, one follows, the rest: 429
    for p, (tokens, done) in zip(prompts, await asyncio.gather(*(collect(h) for h in handles))):
        assert done.finish_reason == "length" and tokens == backend.greedy(p, 4)
    await engine.shutdown(1)


async def test_landed_clones_are_inside_the_budget():
    """Followers hold the bytes of the clone they will be handed from the moment they park, so when the
    leader reaches the target and every order is served at once, the backend stays inside the budget."""
    backend = Watched()
    budget = 700 * KIB  # the leader's 209 tokens and two clones of 200; a third does not fit
    engine = await start_engine(backend, **FOLLOW, inference_slots=2, kv_budget_bytes=budget)
    prompts = [SHARED + [10 + i] * T for i in range(8)]
    results = await asyncio.gather(*(run(engine, p, 4, rid=f"r{i}") for i, p in enumerate(prompts)))
    for p, (tokens, done) in zip(prompts, results):
        assert done.finish_reason == "length" and tokens == backend.greedy(p, 4)
    assert sum(d.usage.reused_tokens for _, d in results) >= 2 * S  # followers did follow
    assert backend.peak <= budget
    assert engine.metrics.budget_exceeded.get() == 0
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


async def test_an_expired_head_lets_the_request_behind_it_in_at_once():
    backend = ScriptedBackend()
    gate = backend.gates["decode"] = Gate()
    # 150 tokens: the runner's 60 leave room for a 20-token request, not for a 110-token one
    engine = await start_engine(backend, kv_budget_bytes=150 * KIB, prefix_cache_entries=0, inference_slots=2,
                                queue_timeout=1.0)
    running = engine.submit(request(prompt_of(10, start=1), 50, rid="running"))
    await reached(gate)  # the runner is held inside its first decode: no step event wakes admission
    big = engine.submit(request(prompt_of(10, start=2), 100, rid="big"))
    await asyncio.sleep(0.5)
    small = engine.submit(request(prompt_of(10, start=3), 10, rid="small"))
    _, big_done = await collect(big)
    assert big_done.finish_reason == "error" and "queue-timeout" in big_done.error
    # admission ran again when the head expired: the small request holds a slot before its own timeout
    await until(lambda: any(r.req.request_id == "small" and not isinstance(r.phase, Queued) for r in engine.requests())
                or small.done is not None, timeout=10)
    gate.open()
    tokens, done = await collect(small)
    assert done.finish_reason == "length" and tokens == backend.greedy(prompt_of(10, start=3), 10)
    await collect(running)
    await engine.shutdown(1)


async def test_a_loan_gives_way_before_the_prefix_cache():
    """Bytes lent out of the budget (a pool's kept model, loans.py) count as held, never as a request's, and are
    called back as soon as a request needs them, before any cache entry is evicted."""
    backend = ScriptedBackend()
    engine = await start_engine(backend, kv_budget_bytes=100 * KIB, prefix_cache_min_tokens=16, queue_timeout=30)
    cached = prompt_of(30, start=1)
    await run(engine, cached, 10)
    await until(lambda: engine.stats().cached == 1)
    held, called = engine.stats().held, []
    assert engine.serving.admission.lend("too big", 100 * KIB - held + 1, lambda: called.append("too big")) is None
    end = engine.serving.admission.lend("kept", 30 * KIB, lambda: called.append("kept"))
    assert end is not None
    assert engine.stats().held == held + 30 * KIB and engine.utilization().used_tokens == 0
    tokens, done = await run(engine, prompt_of(10, start=2), 20)  # 30 tokens fit beside the loan and the cache
    assert called == [] and done.finish_reason == "length"
    short = prompt_of(10, start=3)
    tokens, done = await run(engine, short, 50)  # 60 do not: the loan goes, the cache stays
    assert called == ["kept"] and engine.stats().cached == 1
    assert done.finish_reason == "length" and tokens == backend.greedy(short, 50)
    end()  # called back already: nothing to end
    await settled(engine, backend)
    assert engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


def test_a_report_above_the_budget_is_counted():
    from kvfork.server.engine.loop.telemetry import EngineMetrics
    from kvfork.server.watch.metrics import Registry

    class Idle:  # the gauges read nothing in this test
        admission = reuse = None

    metrics = EngineMetrics(Registry(), Idle())
    metrics.holding(100, 100)
    assert metrics.budget_exceeded.get() == 0
    metrics.holding(101, 100)
    assert metrics.budget_exceeded.get() == 1


def _request_named(engine, request_id):
    return next((r for r in engine.requests() if r.req.request_id == request_id), None)


async def test_a_clone_now_order_stays_held_after_its_request_leaves():
    """A request cancelled while the runner clones for it (in its Start): the clone exists until the
    runner's answer comes back and its session is released, so the request and its bytes stay until
    then and nobody is admitted into them (the soak saw the backend hold a growth step over the budget
    this way)."""
    backend = Watched()
    backend.delay["decode"] = 0.01
    shared = SHARED + [10] * T
    # the donor grows to 205 + 40 tokens, the recipient to 209; a newcomer of 24 fits only once the
    # recipient's clone of 200 is gone
    engine = await start_engine(backend, active_prefix_reuse_min_tokens=8, follow=False, prefix_cache_entries=0,
                                prefill_chunk=32, inference_slots=3, kv_budget_bytes=(245 + 209 + 10) * KIB)
    donor = engine.submit(request(shared, 40, rid="donor"))
    await until(lambda: (d := _request_named(engine, "donor")) is not None and d.committed > len(shared))
    gate = backend.gates["clone"] = Gate()
    recipient = engine.submit(request(SHARED + [20] * T, 4, rid="recipient"))
    started = _request_named(engine, "recipient")
    assert isinstance(started.phase, Prefilling) and started.phase.donor_upto  # its Start carries the donor clone
    await reached(gate)  # the runner is making the clone
    recipient.cancel()
    assert engine.stats().held >= 245 * KIB + 200 * KIB  # the clone is still the runner's to hand back
    newcomer = engine.submit(request(prompt_of(20, start=9), 4, rid="newcomer"))
    assert _request_named(engine, "newcomer").phase.__class__ is Queued
    gate.open()
    _, done = await collect(recipient)
    assert done.finish_reason == "cancelled"
    tokens, done = await collect(newcomer)
    assert done.finish_reason == "length" and tokens == backend.greedy(prompt_of(20, start=9), 4)
    await collect(donor)
    assert backend.peak <= engine.config.kv_budget_bytes
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


async def test_a_served_follow_order_stays_held_after_its_follower_leaves():
    """A parked follower cancelled while the runner serves its order: as above, its clone's bytes stay
    held until the runner's answer comes back."""
    backend = Watched()
    prefill = backend.gates["prefill"] = Gate()
    leader_prompt = SHARED + [10] * T
    # the leader grows to 209 tokens; the follower's clone is 200; a newcomer of 24 fits only without it
    engine = await start_engine(backend, **FOLLOW, inference_slots=3, kv_budget_bytes=(209 + 200 + 10) * KIB)
    leader = engine.submit(request(leader_prompt, 4, rid="leader"))
    await reached(prefill)  # the leader's first chunk: it has committed nothing yet
    follower = engine.submit(request(SHARED + [20] * T, 4, rid="follower"))
    f = _request_named(engine, "follower")
    assert isinstance(f.phase, Following) and f.phase.registered
    clone = backend.gates["clone"] = Gate()
    prefill.open()
    await reached(clone)  # the leader reached the target: the runner is making the follower's clone
    follower.cancel()
    _, done = await collect(follower)
    assert done.finish_reason == "cancelled"
    assert engine.stats().held >= 209 * KIB + 200 * KIB
    newcomer = engine.submit(request(prompt_of(20, start=9), 4, rid="newcomer"))
    assert _request_named(engine, "newcomer").phase.__class__ is Queued
    clone.open()
    tokens, done = await collect(newcomer)
    assert done.finish_reason == "length" and tokens == backend.greedy(prompt_of(20, start=9), 4)
    await collect(leader)
    assert backend.peak <= engine.config.kv_budget_bytes
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


async def test_a_follower_cancelled_before_its_order_is_served_gives_its_bytes_back():
    """The runner answers an order it dropped, so the bytes held for it come back."""
    backend = Watched()
    prefill = backend.gates["prefill"] = Gate()
    engine = await start_engine(backend, **FOLLOW, inference_slots=3)
    leader = engine.submit(request(SHARED + [10] * T, 4, rid="leader"))
    await reached(prefill)
    follower = engine.submit(request(SHARED + [20] * T, 4, rid="follower"))
    assert _request_named(engine, "follower").phase.registered
    follower.cancel()  # its order is at the runner, waiting for the leader
    await collect(follower)
    prefill.open()
    await collect(leader)
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and not engine.stats().abandoned
    await engine.shutdown(1)


async def test_a_queued_request_holds_its_named_sessions_state():
    """From the moment a request acquires its named session, the table no longer counts the session as
    idle: the request holds those bytes, queued or not (else the budget lost them while it waited)."""
    backend = ScriptedBackend()
    engine = await start_engine(backend, kv_budget_bytes=100 * KIB, prefix_cache_entries=0, inference_slots=1)
    a = prompt_of(30, start=1)
    first, _ = await run(engine, a, 10, session_id="a")  # idle: 39 tokens committed
    turn = a + first[:9] + [7]
    gate = backend.gates["decode"] = Gate()
    blocker = engine.submit(request(prompt_of(10, start=5), 20, rid="blocker"))
    await reached(gate)
    again = engine.submit(request(turn, 4, rid="again", session_id="a"))  # queued behind the blocker
    assert _request_named(engine, "again").phase.__class__ is Queued
    assert engine.stats().held >= backend.total_bytes()  # the 39 tokens still live are counted
    gate.open()
    tokens, done = await collect(again)
    assert done.finish_reason == "length" and done.usage.reused_tokens == 39
    assert tokens == backend.greedy(turn, 4)
    await collect(blocker)
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


def test_byte_gauges_render_exactly():
    """The soak compares the backend's bytes with the budget's to the byte, read from /metrics."""
    from kvfork.server.watch.metrics import Gauge

    assert Gauge("kvfork_kv_bytes", "bytes", lambda: 3_014_656).render()[-1] == "kvfork_kv_bytes 3014656"
    assert Gauge("x", "ratio", lambda: 0.25).render()[-1] == "x 0.25"


async def test_admission_evicts_the_entry_a_request_reuses_last(monkeypatch):
    """Room for a returning request is made from the cache entries it does not start from first: evicting
    its own match (the least recently used) to admit it would turn its reuse into a full prefill."""
    backend = ScriptedBackend()
    a, b = prompt_of(60, start=1), prompt_of(60, start=2)
    engine = await start_engine(backend, kv_budget_bytes=192 * KIB, queue_timeout=30)
    for p in (a, b):
        await run(engine, p, 10)
        await settled(engine, backend)
    assert engine.stats().cached == 2  # both kept; a is the least recently used
    lookups, best = [], Index.best
    monkeypatch.setattr(Index, "best", lambda i, *args, **kw: lookups.append(args) or best(i, *args, **kw))
    tokens, done = await run(engine, a + [7, 8, 9], 10)
    assert len(lookups) == 1  # placement starts from the lookup admission made room with (Request.found)
    assert done.usage.reused_tokens >= 59  # b gave way, not a
    assert tokens == backend.greedy(a + [7, 8, 9], 10)
    await settled(engine, backend)
    assert engine.stats().held == backend.total_bytes()
    await engine.shutdown(1)


async def test_a_running_requests_pinned_images_are_counted_in_its_reservation():
    backend = ReadsImages()
    gate = backend.gates["decode"] = Gate()
    engine = await start_engine(backend, prefix_cache_entries=0)
    keys = image_keys(0x1234, 40)
    prompt = prompt_of(10) + keys + prompt_of(5)
    handle = engine.submit(request(prompt, 4, images=(ImageInput(0x1234, 10, 50, 40),)))
    await reached(gate)
    adm = engine.serving.admission
    assert engine.stats().reserved == adm.request_bytes(len(prompt), 4, start=0) + 40 * ReadsImages.EMBEDDING
    gate.open()
    await collect(handle)
    await settled(engine, backend)
    assert engine.stats().reserved == 0
    await engine.shutdown(1)
