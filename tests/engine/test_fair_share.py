"""Fair shares between tenants (issue 33, finding 8): the pure policy (server/engine/policy/fair_share.py), over every
small case, and the engine applying it: a tenant alone uses every slot and the whole queue; under contention,
a full queue makes room for a tenant below its share, free slots go to the tenant holding fewest, and a tenant
above its share of the slots pauses a decoding request for one waiting below its own (issue 45): the waiting
tenant's first token comes within steps, and the paused request decodes on to the tokens it had alone."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from engine_harness import collect, prompt_of, reached, request, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.backends.base import SamplingParams
from kvfork.server.engine.api import CapacityExhausted, Scope
from kvfork.server.engine.loop.request import Decoding, Paused
from kvfork.server.engine.policy.fair_share import give_way, next_in_line, preempt, share, sit_out

TENANTS = ("a", "b", "c")


def test_give_way_over_every_small_queue():
    for capacity in range(1, 7):
        for counts in itertools.product(range(capacity + 1), repeat=len(TENANTS)):
            if sum(counts) != capacity:
                continue  # give_way is asked only of a full queue
            waiting = dict(zip(TENANTS, counts))
            for tenant in (*TENANTS, "new"):
                victim = give_way(waiting, tenant, capacity)
                active = {t for t, n in waiting.items() if n} | {tenant}
                each = share(capacity, len(active))
                if victim is None:
                    # refused: at its share already, or nobody above theirs
                    assert waiting.get(tenant, 0) >= each or all(n <= each for t, n in waiting.items() if t != tenant)
                    continue
                assert victim != tenant and waiting[victim] > each > waiting.get(tenant, 0)
                assert waiting[victim] == max(n for t, n in waiting.items() if t != tenant)
                if len(active) == 1:
                    pytest.fail("a tenant alone never takes a place from itself")


def test_a_tenant_alone_may_fill_the_queue_and_a_second_gets_its_share():
    waiting = {"a": 32}
    assert give_way(waiting, "a", 32) is None  # alone and full: refused, as at any full queue
    taken = 0
    while (victim := give_way(waiting, "b", 32)) is not None:  # b arrives, again and again
        waiting[victim] -= 1
        waiting["b"] = waiting.get("b", 0) + 1
        taken += 1
    assert waiting == {"a": 16, "b": 16} and taken == 16


def test_next_in_line_over_every_small_queue():
    for length in range(0, 6):
        for queued in itertools.product(TENANTS, repeat=length):
            for held in itertools.product(range(3), repeat=len(TENANTS)):
                in_slots = dict(zip(TENANTS, held))
                at = next_in_line(list(queued), in_slots)
                if not queued:
                    assert at is None
                    continue
                chosen = queued[at]
                assert queued.index(chosen) == at  # a tenant's requests keep their order
                fewest = min(in_slots[t] for t in set(queued))
                assert in_slots[chosen] == fewest
                assert all(queued.index(t) > at for t in set(queued) if in_slots[t] == fewest and t != chosen)


def test_without_contention_the_order_is_first_come():
    assert next_in_line(["a", "a", "b"], {}) == 0 and next_in_line(["", "", ""], {"": 5}) == 0
    assert next_in_line(["a", "a", "b"], {"a": 8}) == 2  # b holds none: its first request goes first


@pytest.fixture
async def gated():
    """Makes an engine over a scripted backend whose decode steps wait at a gate, with `slots` inference slots
    and no prefix reuse; each is opened and shut down after the test."""
    made = []

    async def make(slots: int, **config):
        backend = ScriptedBackend()
        gate = backend.gates["decode"] = Gate()
        engine = await start_engine(backend, inference_slots=slots, prefix_cache_entries=0,
                                    active_prefix_reuse_min_tokens=0, **config)
        made.append((engine, gate))
        return engine, backend, gate

    yield make
    for engine, gate in made:
        gate.open()
        await engine.shutdown(1)


async def test_one_tenant_cannot_shut_another_out_of_slots_and_queue(gated):
    """Tenant A fills the 2 slots and the queue of 4; B still gets in (A's newest queued request gives way
    with a 429), and the next free slot is B's."""
    engine, backend, gate = await gated(2, max_queue=4)
    a, b = Scope("tenant-a"), Scope("tenant-b")
    handles = [engine.submit(request(prompt_of(20, 100 * i), 4, rid=f"a{i}", scope=a)) for i in range(6)]
    await asyncio.to_thread(gate.reached.wait, 30)
    with pytest.raises(CapacityExhausted):  # alone at a full queue: refused as before
        engine.submit(request(prompt_of(20, 700), 4, rid="a6", scope=a))
    b_handle = engine.submit(request(prompt_of(20, 900), 4, rid="b0", scope=b))
    _, gave = await collect(handles[5])
    assert gave.finish_reason == "error" and gave.gave_way  # A's newest waiting request
    order: list[str] = []

    async def track(rid, handle):
        await collect(handle)
        order.append(rid)

    gate.open()
    await asyncio.gather(*(track(f"a{i}", h) for i, h in enumerate(handles[:5])), track("b0", b_handle))
    # b0 took the first slot that came free: it ended before A's last queued requests
    assert order.index("b0") < order.index("a4")


def test_preempt_over_every_small_batch():
    for slots in range(1, 6):
        for held in itertools.product(range(slots + 1), repeat=len(TENANTS)):
            if sum(held) > slots:
                continue
            in_slots = dict(zip(TENANTS, held))
            for waiting in (*TENANTS, "new"):
                for k in range(len(TENANTS) + 1):
                    for pausable in itertools.combinations(TENANTS, k):
                        victim = preempt(in_slots, waiting, slots, set(pausable))
                        active = {t for t, n in in_slots.items() if n} | {waiting}
                        each = share(slots, len(active))
                        mine = in_slots.get(waiting, 0)
                        over = [t for t in pausable if t != waiting and in_slots[t] > each]
                        if victim is None:
                            assert mine >= each or not over
                            continue
                        assert victim in pausable and victim != waiting
                        assert in_slots[victim] > each > mine  # both end within their shares or nearer
                        assert in_slots[victim] - 1 >= each >= mine + 1  # so the slot never comes back
                        assert in_slots[victim] == max(in_slots[t] for t in over)


def test_a_hog_gives_slots_back_until_the_shares_are_even():
    in_slots, slots = {"a": 16}, 16
    paused = 0
    while (victim := preempt(in_slots, "b", slots, {"a"})) is not None:  # b waits, with more to run
        in_slots[victim] -= 1
        in_slots["b"] = in_slots.get("b", 0) + 1
        paused += 1
    assert in_slots == {"a": 8, "b": 8} and paused == 8
    assert preempt({"a": 1}, "b", 1, {"a"}) is None  # one slot: a share of 1 each, a holds no more than its own
    assert preempt({"a": 2}, "b", 2, set()) is None  # nothing a can pause (prefilling): b waits for an end


def test_sit_out_over_every_small_batch():
    for slots in range(1, 6):
        for held in itertools.product(range(slots + 1), repeat=len(TENANTS)):
            if sum(held) > slots:
                continue
            tenants = [t for t, n in zip(TENANTS, held) for _ in range(n)]
            each = share(slots, len({*tenants}))
            for lefts in itertools.product((0, 3, 9), repeat=len(tenants)):
                rows = list(zip(tenants, lefts))
                for k in range(len(TENANTS) + 1):
                    for last in map(frozenset, itertools.combinations(TENANTS, k)):
                        out = sit_out(rows, slots, 4, last)
                        below = any(tenants.count(t) < each and 0 < left <= 4 for t, left in rows)
                        if not below:
                            assert out == frozenset()  # nobody below its share is one chunk from its first token
                            continue
                        assert out == {t for t in tenants if tenants.count(t) > each} - last
                        assert not out & last  # never two steps in a row


def test_a_hog_sits_out_the_innocents_first_step_only():
    rows = [("a", 0)] * 15 + [("b", 14)]
    assert sit_out(rows, 16, 512, frozenset()) == {"a"}
    assert sit_out(rows, 16, 512, frozenset({"a"})) == frozenset()  # then a runs a step, whatever b has left
    assert sit_out(rows, 16, 8, frozenset()) == frozenset()  # b's prompt is more than a chunk from its token
    assert sit_out([("a", 0)] * 8 + [("b", 3)] * 8, 16, 512, frozenset()) == frozenset()  # even shares
    assert sit_out([("", 0)] * 15 + [("", 3)], 16, 512, frozenset()) == frozenset()  # one tenant


async def test_the_innocents_first_step_holds_none_of_the_hogs_rows():
    """A holds 3 of 4 slots decoding (its newest paused for B): the step that prefills B's prompt carries no row
    of A's, the step after it carries A's again, and every request generates the tokens it generates alone."""
    backend, plans = ScriptedBackend(), []
    gate = backend.gates["decode"] = Gate()
    engine = await start_engine(backend, plans=plans.append, inference_slots=4, prefix_cache_entries=0,
                                active_prefix_reuse_min_tokens=0)
    try:
        hog = [engine.submit(request(prompt_of(20, 100 * i), 12, rid=f"a{i}", scope=Scope("tenant-a")))
               for i in range(4)]
        await reached(gate)
        await until(lambda: all(isinstance(_phase(engine, f"a{i}"), Decoding) for i in range(4)))
        innocent = engine.submit(request(prompt_of(20, 900), 4, rid="b0", scope=Scope("tenant-b")))
        assert isinstance(_phase(engine, "a3"), Paused)
        rids = {r.req.request_id: r.rid for r in engine.requests()}
        gate.open()
        results = await asyncio.gather(*(collect(h) for h in (*hog, innocent)))
    finally:
        gate.open()
        await engine.shutdown(1)
    hogs = {rids[f"a{i}"] for i in range(4)}
    first = next(i for i, plan in enumerate(plans) if any(row.rid == rids["b0"] for row in plan.prefill))
    assert not {row.rid for row in plans[first].decode + plans[first].prefill} & hogs
    assert {row.rid for row in plans[first + 1].decode} >= {rids[f"a{i}"] for i in range(3)}
    for i, (tokens, done) in enumerate(results[:4]):
        assert tokens == backend.greedy(prompt_of(20, 100 * i), 12) and done.finish_reason == "length"
    assert results[4][0] == backend.greedy(prompt_of(20, 900), 4)


def _phase(engine, rid):
    return next((r.phase for r in engine.requests() if r.req.request_id == rid), None)


async def test_a_hog_pauses_a_request_for_the_innocent_and_it_decodes_on_unchanged(gated):
    """A holds both slots with long generations (one of them seeded); B's request gets a slot at once: A's
    newest pauses (its session kept), B's first token comes before A's requests end, and A's paused request
    then decodes on to exactly the tokens it generates alone."""
    engine, backend, gate = await gated(2)
    a, b = Scope("tenant-a"), Scope("tenant-b")
    seeded = SamplingParams(temperature=0.8, seed=7)
    hog = [engine.submit(request(prompt_of(20, 100 * i), 40, rid=f"a{i}", scope=a,
                                 **({"sampling": seeded} if i else {}))) for i in range(2)]
    await reached(gate)
    await until(lambda: all(isinstance(_phase(engine, f"a{i}"), Decoding) for i in range(2)))
    innocent = engine.submit(request(prompt_of(20, 900), 4, rid="b0", scope=b))
    assert isinstance(_phase(engine, "a1"), Paused)  # the newest, at once: no end awaited
    stats = engine.stats()
    assert (stats.paused, stats.queued, stats.slots_used) == (1, 0, 2)
    gate.open()
    (a0, _), (a1, done1), (b0, _) = await asyncio.gather(*(collect(h) for h in (*hog, innocent)))
    # in the runner's calls: b0 prefilled and decoded beside a0 while a1 sat out, then a1 decoded on
    prefills = [sid for call in backend.calls if call[0] == "prefill" for sid, _ in call[1]]
    s0, s1, sb = prefills
    decodes = [set(call[1]) for call in backend.calls if call[0] == "decode"]
    with_b = [i for i, rows in enumerate(decodes) if sb in rows]
    assert with_b and all(decodes[i] == {s0, sb} for i in with_b)
    assert s1 in decodes[0] and any(s1 in rows for rows in decodes[with_b[-1] + 1:])
    assert engine.metrics.preemptions.get() == 1
    assert a0 == backend.greedy(prompt_of(20, 0), 40) and b0 == backend.greedy(prompt_of(20, 900), 4)
    assert a1 == backend.greedy(prompt_of(20, 100), 40) and done1.finish_reason == "length"
    assert done1.usage.prefilled_tokens == 20  # resumed from its own session: nothing prefilled again
    await settled(engine, backend)
    assert backend.live_sessions() == 0


async def test_a_paused_request_cancelled_leaves_nothing_behind(gated):
    engine, backend, gate = await gated(2)
    a = Scope("tenant-a")
    hog = [engine.submit(request(prompt_of(20, 100 * i), 10_000, rid=f"a{i}", scope=a)) for i in range(3)]
    await reached(gate)
    await until(lambda: all(isinstance(_phase(engine, f"a{i}"), Decoding) for i in range(2)))
    innocent = engine.submit(request(prompt_of(20, 900), 10_000, rid="b0", scope=Scope("tenant-b")))
    assert isinstance(_phase(engine, "a1"), Paused)
    hog[1].cancel()  # the client of the paused request goes away
    gate.open()
    _, done = await collect(hog[1])
    assert done.finish_reason == "cancelled"
    await until(lambda: backend.live_sessions() == 2)  # a0's and b0's: a1's session was released
    stats = engine.stats()
    assert (stats.paused, stats.queued, stats.slots_used) == (0, 1, 2)  # a2 waits: each tenant holds its share
    engine.submit(request(prompt_of(20, 500), 10_000, rid="b1", scope=Scope("tenant-b")))
    assert engine.stats().paused == 0  # b at its share: nobody pauses for its second request
    engine.submit(request(prompt_of(20, 700), 10_000, rid="c0", scope=Scope("tenant-c")))
    assert engine.stats().paused == 0  # three tenants over two slots: a share of 1, nobody above it
    gate.open()
    await engine.shutdown(1)  # everything still running or paused is cancelled and released
    assert backend.live_sessions() == 0


async def test_a_shutdown_ends_a_paused_request(gated):
    engine, backend, gate = await gated(2)
    hog = [engine.submit(request(prompt_of(20, 100 * i), 10_000, rid=f"a{i}", scope=Scope("tenant-a")))
           for i in range(2)]
    await reached(gate)
    await until(lambda: all(isinstance(_phase(engine, f"a{i}"), Decoding) for i in range(2)))
    engine.submit(request(prompt_of(20, 900), 10_000, rid="b0", scope=Scope("tenant-b")))
    assert engine.stats().paused == 1
    gate.open()
    await engine.shutdown(1)
    _, done = await collect(hog[1])
    assert done.finish_reason == "cancelled" and backend.live_sessions() == 0


async def test_choices_get_every_slot_they_need_or_nobody_pauses(gated):
    """4 slots, all the hog's, decoding: a request of 3 choices cannot get 3 (its share is 2): nobody pauses
    for it. One of 2 choices can: two of the hog's pause, and its choices take both slots at once."""
    engine, backend, gate = await gated(4)
    for i in range(4):
        engine.submit(request(prompt_of(20, 100 * i), 10_000, rid=f"a{i}", scope=Scope("tenant-a")))
    await reached(gate)
    await until(lambda: all(isinstance(_phase(engine, f"a{i}"), Decoding) for i in range(4)))
    engine.submit_choices(request(prompt_of(20, 900), 4, rid="b3", scope=Scope("tenant-b"), n=3))
    assert (engine.stats().paused, engine.stats().queued) == (0, 1)
    engine.submit_choices(request(prompt_of(20, 800), 4, rid="c2", scope=Scope("tenant-c"), n=2))
    stats = engine.stats()  # b's is still next in line, and three tenants make a share of 1 each
    assert (stats.paused, stats.queued) == (0, 2)


async def test_two_choices_take_the_slots_two_pauses_give(gated):
    engine, backend, gate = await gated(4)
    for i in range(4):
        engine.submit(request(prompt_of(20, 100 * i), 10_000, rid=f"a{i}", scope=Scope("tenant-a")))
    await reached(gate)
    await until(lambda: all(isinstance(_phase(engine, f"a{i}"), Decoding) for i in range(4)))
    handles = engine.submit_choices(request(prompt_of(20, 900), 4, rid="b2", scope=Scope("tenant-b"), n=2))
    stats = engine.stats()
    assert (stats.paused, stats.queued, stats.slots_used) == (2, 0, 4)
    assert {type(_phase(engine, f"a{i}")) for i in (2, 3)} == {Paused}  # the newest two
    gate.open()
    for handle in handles:
        tokens, done = await collect(handle)
        assert done.finish_reason == "length" and len(tokens) == 4
