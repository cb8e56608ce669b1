"""Followers' clone orders, which the runner holds until their donors have committed enough.

Runner-private bookkeeping (no backend calls): which orders are due after a
step, where a donor's prefill chunk must stop so a due clone runs before the
donor writes past it (follow.chunk_end), and who inherits a donor that leaves
with orders still waiting (follow.promote).
"""

from __future__ import annotations

from typing import Iterator

from kvfork.server.engine.messages import CloneDonor
from kvfork.server.engine.policy.follow import FollowOrder, chunk_end, promote


class CloneOrders:
    def __init__(self) -> None:
        self._by_donor: dict[int, list[CloneDonor]] = {}

    def add(self, order: CloneDonor) -> None:
        self._by_donor.setdefault(order.donor, []).append(order)

    def due(self, positions: dict[int, int]) -> Iterator[CloneDonor]:
        """Orders whose donor (by rid, at its committed position) now holds what they asked for."""
        for donor, orders in list(self._by_donor.items()):
            for order in [o for o in orders if o.upto <= positions[donor]]:
                orders.remove(order)
                yield order
            if not orders:
                del self._by_donor[donor]

    def drop_recipient(self, rid: int) -> bool:
        """Drop `rid`'s waiting order; whether it had one."""
        dropped = False
        for orders in self._by_donor.values():
            kept = [o for o in orders if o.rid != rid]
            dropped = dropped or len(kept) < len(orders)
            orders[:] = kept
        return dropped

    def prefill_cap(self, donor: int, position: int, prefill_left: int) -> int | None:
        """Most tokens the donor may prefill this step: up to its nearest follower's target."""
        orders = self._by_donor.get(donor)
        if not orders:
            return None
        return chunk_end(position, position + prefill_left, (o.upto for o in orders)) - position

    def leaving(self, donor: int, committed: int, usable: bool) -> tuple[CloneDonor | None, int, list[CloneDonor]]:
        """The donor leaves: (the heir's order, what it inherits, the orders that must plan again)."""
        orders = self._by_donor.pop(donor, [])
        parked = [FollowOrder(o.rid, o.donor, o.upto, o.order, float("inf")) for o in orders]
        promotion = promote(donor, committed, parked, usable)
        heir = next((o for o in orders if o.rid == promotion.heir), None)
        return heir, promotion.upto, [o for o in orders if o is not heir]
