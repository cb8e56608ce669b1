"""Fair shares between tenants, as pure functions: who gets a free inference slot, and who gives way when
the queue is full.

A tenant alone may use every slot and the whole queue (--max-queue). Under contention each gets its
share. The queue's share is the capacity over the tenants waiting (the newcomer counted): a full queue
takes a request of a tenant below its share by turning away the newest waiting request of the tenant
furthest above its own (`give_way`); a tenant at its share or above is refused, as any request is at a
full queue. A free slot goes to the earliest waiting request among those of the tenant holding the fewest
slots (`next_in_line`), and a tenant's requests keep their order among themselves. When no slot is free for a
tenant waiting below its share of the slots, the tenant furthest above its own pauses a running request
(`preempt`): the slot is the waiting tenant's at once, not when a generation of the other ends (on a real
model that is seconds). The step that brings a tenant below its share its first token is its own (`sit_out`): the
rows of the tenants above their shares wait that step out, so the first token costs what it costs alone, not a
step of every row the others hold. Shares of slots are over the tenants in slots or waiting (`sit_out`'s over
those in slots: the runner's, which knows no queue). Tenants are the scope's
(api.Scope.tenant): a daemon without keys has one, and these are first come, first served.
"""

from __future__ import annotations

from collections import Counter
from typing import AbstractSet, Collection, Mapping, Sequence


def share(capacity: int, tenants: int) -> int:
    """Each of `tenants`' share of `capacity` (at least 1)."""
    return max(1, capacity // max(1, tenants))


def give_way(waiting: Mapping[str, int], tenant: str, capacity: int) -> str | None:
    """The queue is full (its `capacity` taken, `waiting` per tenant): the tenant whose newest waiting request
    gives way to one of `tenant`'s, or None, when `tenant` is at its share already (it is refused) or nobody
    is above theirs. Ties go to the tenant with the largest name (any fixed order would do)."""
    active = {t for t, n in waiting.items() if n > 0} | {tenant}
    each = share(capacity, len(active))
    if waiting.get(tenant, 0) >= each:
        return None
    over = [(n, t) for t, n in waiting.items() if t != tenant and n > each]
    return max(over)[1] if over else None


def next_in_line(queued: Sequence[str], in_slots: Mapping[str, int]) -> int | None:
    """Which waiting request (its place in the queue; `queued`: each one's tenant, in the queue's order) the
    next free slot goes to: the first of the tenant holding the fewest slots (`in_slots`). None: nobody waits."""
    first: dict[str, int] = {}
    for at, tenant in enumerate(queued):
        first.setdefault(tenant, at)
    if not first:
        return None
    return min(first.values(), key=lambda at: (in_slots.get(queued[at], 0), at))


def preempt(in_slots: Mapping[str, int], waiting: str, slots: int, pausable: Collection[str]) -> str | None:
    """No slot is free for the `waiting` tenant's next request: the tenant that pauses one of its running
    requests to give it a slot, or None. One does only while `waiting` holds fewer slots (`in_slots`) than its
    share of `slots` and that tenant more than its own; of those, the one holding most (ties: the largest
    name), among the tenants with a request it can pause (`pausable`). A pause leaves both within their shares
    or nearer them, so slots never go back and forth."""
    active = {t for t, n in in_slots.items() if n > 0} | {waiting}
    each = share(slots, len(active))
    if in_slots.get(waiting, 0) >= each:
        return None
    over = [(n, t) for t, n in in_slots.items() if t != waiting and n > each and t in pausable]
    return max(over)[1] if over else None


def sit_out(rows: Sequence[tuple[str, int]], slots: int, chunk: int, last: AbstractSet[str]) -> frozenset[str]:
    """The tenants whose rows wait out this step (`rows`: each running request's tenant and the prompt tokens it
    has left to prefill): while a tenant below its share of `slots` has a prompt within one `chunk` of its first
    token, every tenant above its own share, except those that sat out the step before (`last`): a tenant
    above its share runs at least every other step, whatever the others send. A row that sits out decodes the
    same tokens a step later."""
    held = Counter(tenant for tenant, _ in rows)
    each = share(slots, len(held))
    if not any(held[tenant] < each and 0 < left <= chunk for tenant, left in rows):
        return frozenset()
    return frozenset(t for t, n in held.items() if n > each and t not in last)
