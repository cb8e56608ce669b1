"""Fair shares between tenants (issue 33, finding 8): the pure policy (server/engine/fair_share.py), over every
small case, and the engine applying it: a tenant alone uses every slot and the whole queue; under contention,
a full queue makes room for a tenant below its share, and free slots go to the tenant holding fewest."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from engine_harness import collect, prompt_of, request, start_engine
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.api import CapacityExhausted, Scope
from kvfork.server.engine.fair_share import give_way, next_in_line, share

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


async def test_one_tenant_cannot_shut_another_out_of_slots_and_queue():
    """Tenant A fills the 2 slots and the queue of 4; B still gets in (A's newest queued request gives way
    with a 429), and the next free slot is B's."""
    backend = ScriptedBackend()
    gate = backend.gates["decode"] = Gate()
    engine = await start_engine(backend, inference_slots=2, max_queue=4, prefix_cache_entries=0,
                                active_prefix_reuse_min_tokens=0)
    a, b = Scope("tenant-a"), Scope("tenant-b")
    try:
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
    finally:
        gate.open()
        await engine.shutdown(1)
