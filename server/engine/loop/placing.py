"""The view a request is placed over (policy/placement.py's `View`), taken from what the engine has: its requests,
the parked followers, the index, the measured rates. `place` then decides over the view alone."""

from __future__ import annotations

from typing import Collection, Iterable

from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.request import Following, Prefilling, Queued, Request
from kvfork.server.engine.policy.follow import FollowPolicy, Leader, leader_views
from kvfork.server.engine.policy.matching import Source
from kvfork.server.engine.policy.placement import View
from kvfork.server.engine.policy.rates import Rates


def take_view(r: Request, requests: Collection[Request], followers: Iterable[Request], index: Index, rates: Rates,
              config: EngineConfig, disk: bool, slot: bool, now: float) -> View:
    """The view `r` is placed over: `requests`, all the engine has, in admission order; `followers`, the parked
    ones, in the order they parked; `disk`: the disk tier is on."""
    waited = now - r.tried.first_parked_at if r.tried.first_parked_at else 0.0
    policy = FollowPolicy(config.active_prefix_reuse_min_tokens, follow=config.follow and not r.tried.no_follow,
                          max_wait_s=max(0.0, config.follow_max_wait - waited))
    restore = disk and not r.tried.no_disk and not r.siblings
    busy = prefilling(requests)
    leaders = (_leaders(r, requests, list(followers), index, rates, busy)
               if policy.min_tokens > 0 and r.named is None else [])
    found = r.found if r.found is not None and not restore else index.best(r.prompt, r.req.scope, disk=restore)
    return View(found, leaders, rates, busy, policy,
                config.prefix_cache_min_tokens, restore, slot, {x.rid: x.req.request_id for x in requests})


def prefilling(requests: Iterable[Request]) -> int:
    """Requests prefilling now (each choice's prompt once): they share the prefill rate."""
    return sum(1 for x in requests if isinstance(x.phase, Prefilling) and x.committed < len(x.prompt)
               and x.parent is None)


def _leaders(r: Request, requests: Iterable[Request], followers: list[Request], index: Index, rates: Rates,
             prefilling: int) -> list[Leader]:
    """Whom `r` may follow: its scope's requests in slots, those whose clone is on its way, and the parked
    followers (follow.leader_views), never its own followers."""
    tps = rates.share(prefilling)  # a leader prefills at its share of the rate; a follower does not compete
    below, scope = _followers_below(r, followers), r.req.scope
    active = []
    for x in requests:
        # a request on its way out gives nothing; another scope's never; a choice is its parent's twin
        if x is r or x.rid in below or x.ending or x.req.scope != scope or x.parent is not None:
            continue
        if isinstance(x.phase, Prefilling) and x.phase.donor_upto:  # holds [0, donor_upto) once cloned
            source = Source.donor(x.rid, x.prompt, 0, x.rid)
            active.append(Leader.starting(source, x.phase.donor_upto, rates.clone_s(x.phase.donor_upto), tps))
        elif x.holds_slot:
            active.append(Leader.active(index.source_of(x.rid), tps))
        elif isinstance(x.phase, Queued) and x.phase.landed is not None:  # holds it already, waits for a slot
            source = Source.donor(x.rid, x.prompt, 0, x.rid)
            active.append(Leader.starting(source, x.phase.landed.upto, 0.0, tps))
    parked = [(f.phase.order, Source.donor(f.rid, f.prompt, 0, f.rid)) for f in followers
              if isinstance(f.phase, Following) and f.rid not in below and f is not r and f.req.scope == scope]
    return leader_views(active, parked, rates, tps)


def _followers_below(r: Request, followers: list[Request]) -> set[int]:
    """Everyone following `r`, directly or down a chain: never a leader for `r`."""
    below, grew = {r.rid}, True
    while grew:
        grew = False
        for f in followers:
            if f.rid not in below and isinstance(f.phase, Following) and f.phase.order.leader in below:
                below.add(f.rid)
                grew = True
    return below - {r.rid}
