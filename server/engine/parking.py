"""Parked followers: their views as leaders, their chunk stops, and promotion. Pure policy.

The engine flow and the rules are in follow.py's docstring. Here:
  leader_views(active, parked, rates, tps) -> list[Leader]
  Following.park(request_id, plan, order, first_parked_at, max_wait_s) -> Following
  Following.ready(leader_committed) -> bool; Following.expired(now) -> bool
  chunk_end(committed, planned_end, stops) -> int
  promote(gone, gone_committed, parked, state_usable) -> Promotion
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable

from server.engine.follow import Leader, Plan
from server.engine.matching import Source
from server.engine.rates import Rates


@dataclass(frozen=True)
class Following:
    """A parked request. It holds no inference slot and counts against the queue limits."""

    request_id: Hashable
    leader: Hashable
    target: int  # clone [0, target) from the leader once it has committed that much
    order: int  # arrival order, lower = earlier
    deadline: float  # engine clock; past it, stop following and take the seed's path

    @classmethod
    def park(cls, request_id: Hashable, plan: Plan, order: int, first_parked_at: float, max_wait_s: float) -> Following:
        # The deadline runs from the FIRST time the request parked: a follower that
        # parks again after a promotion keeps it, so no follower waits forever.
        assert plan.follow and plan.leader is not None
        return cls(request_id, plan.leader, plan.target, order, first_parked_at + max_wait_s)

    # When ready, the clone should be taken before the leader writes again (see chunk_end).
    def ready(self, leader_committed: int) -> bool:
        return leader_committed >= self.target

    def expired(self, now: float) -> bool:
        return now >= self.deadline


def chunk_end(committed: int, planned_end: int, stops: Iterable[int]) -> int:
    """Where a leader's prefill chunk [committed, planned_end) ends: its followers' targets inside it cut it.

    `stops`: the targets of the requests following it.
    """
    # A sliding-window layer keeps only its last W positions, so a clone at
    # `target` must be taken before the leader writes far past it
    # (backends.base.clone_refusal): the chunk stops there and the runner serves
    # the ready followers' clones before the leader's next write.
    return min((s for s in stops if committed < s < planned_end), default=planned_end)


@dataclass(frozen=True)
class Promotion:
    heir: Hashable | None  # plans first, offered the gone leader's state; may take its slot
    upto: int  # what the heir would salvage by the seed's rule: min(its target, gone_committed)
    # Everyone else who waited on the gone leader, directly or down a chain
    # (the heir's own followers too), earliest first.
    replan: tuple[Hashable, ...]


def promote(gone: Hashable, gone_committed: int, parked: Iterable[Following], state_usable: bool = True) -> Promotion:
    """A leader is cancelled or failed; `parked`: every parked follower.

    `gone_committed`: its committed position (0 if it was itself parked);
    `state_usable`: False when its state cannot be cloned (a failed step).
    Unpark the heir and `replan`. Plan the heir first with the gone state added
    to the leaders as Leader.active(its source, tps=0.0), a state that will not
    move; if the heir's plan clones from it, clone BEFORE releasing it. Then plan
    the others in order: they find the heir as their leader.
    """
    children: dict[Hashable, list[Following]] = {}
    for f in parked:
        children.setdefault(f.leader, []).append(f)

    def salvage(f: Following) -> int:
        return min(f.target, gone_committed) if state_usable else 0

    # The heir is the follower that salvages most of what the leader committed
    # (ties: the earliest), so as little as possible is computed again. It plans
    # rather than simply cloning: another leader may offer it more. Everyone below
    # the gone leader plans again, so no request is planned while another follows it.
    direct = sorted(children.get(gone, []), key=lambda f: f.order)
    heir = max(direct, key=salvage, default=None)
    if heir is not None and salvage(heir) <= 0:
        heir = None
    below, todo = [], list(direct)
    while todo:
        f = todo.pop()
        below.append(f)
        todo.extend(children.get(f.request_id, []))
    replan = tuple(f.request_id for f in sorted(below, key=lambda f: f.order) if f is not heir)
    return Promotion(heir.request_id if heir else None, salvage(heir) if heir else 0, replan)


def leader_views(active: Iterable[Leader], parked: Iterable[tuple[Following, Source]], rates: Rates,
                 tps: float) -> list[Leader]:
    """Everyone a newcomer may follow: `active` (Leader.active of each admitted
    request), then each parked follower with its prompt's Source (committed 0: it
    holds nothing yet), IN THE ORDER THEY PARKED, each seen as starting when its
    own leader reaches its target and the clone lands. `tps`: the rate a follower
    will prefill at once it starts.
    """
    # A follower parks after its leader is a leader, and a re-planned one parks
    # again after it, so park order builds every leader's view before its followers'.
    views = {lead.source.key: lead for lead in active}
    for f, source in parked:
        lead = views.get(f.leader)
        after = (lead.eta(f.target) if lead else math.inf) + rates.clone_s(f.target)
        views[f.request_id] = Leader.starting(source, f.target, after, tps, f.leader)
    return list(views.values())
