"""Active prefix reuse and following, on the control loop.

When an anonymous request gets a slot, `place` asks the pure policy
(follow.plan, over matching.choose_reuse) where it starts from:
- clone-now: clone what the best donor has committed NOW (one attempt,
  in the recipient's Start, with the prefix cache's candidates behind it), the
  prefix cache, or nothing;
- or follow (unless --no-follow): park without a slot, the runner clones
  `[0, target)` from the leader the moment the leader has committed it, and the
  follower then takes the next free slot ahead of the queue and prefills its tail.
A parked follower holds no slot, but the bytes of the clone it will be handed
are in the budget from the moment it parks until its clone is released or its
request takes a slot (and grows the hold to its own).
Every failure (refused clone, donor or leader gone) sends the request back to
the head of the queue: the normal admission path, with a fresh cache lookup.
Donors, leaders and cache entries are drawn from the request's own scope only
(api.Scope): another tenant's running prompt is never cloned nor followed.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from backends.base import ModelInfo, clone_positions
from server.engine import messages as m
from server.engine.follow import FollowPolicy, Following, Leader, Plan, leader_views, plan
from server.engine.matching import Recipient, Source, window_floor
from server.engine.rates import RateTracker
from server.engine.request import Phase, Request

if TYPE_CHECKING:
    from server.engine.admission import Admission
    from server.engine.config import EngineConfig
    from server.engine.telemetry import EngineMetrics


class Core(Protocol):
    """What reuse needs of the engine core (engine.Engine): its public interface for collaborators."""

    config: "EngineConfig"
    metrics: "EngineMetrics"

    @property
    def adm(self) -> "Admission": ...
    def send(self, command: Any) -> None: ...
    def request(self, rid: int) -> Request | None: ...
    def requests(self) -> Iterable[Request]: ...
    def admit(self) -> None: ...
    def start_request(self, r: Request, **source: Any) -> None: ...
    def complete(self, r: Request, reason: str) -> None: ...
    def expire_at(self, r: Request, deadline: float) -> None: ...


class Reuse:
    def __init__(self, engine: Core, info: ModelInfo):
        self.engine = engine
        self.rates = RateTracker()
        self.followers: dict[int, Request] = {}  # parked, in park order
        self.windows = [layer.window for layer in info.layers if layer.kind == "sliding" and layer.window]
        self.info = info
        self.recurrent = any(layer.kind == "recurrent" for layer in info.layers)

    @property
    def enabled(self) -> bool:
        return self.engine.config.active_prefix_reuse_min_tokens > 0

    # ---- admission ----

    def place(self, r: Request) -> None:
        """`r` holds a slot: start it, clone for it, or park it behind a leader."""
        engine = self.engine
        if r.landed is not None:  # its clone landed while it was parked
            session, upto = r.landed
            r.landed = None
            engine.start_request(r, resume=session, resume_at=upto)
            return
        if r.named is not None or not self.enabled:
            engine.start_request(r)
            return
        decided = self._plan(r)
        if decided.follow:
            engine.adm.free_slot(r)
            engine.adm.free_capture_slot(r)
            held = engine.adm.hold(r, engine.adm.clone_bytes(decided.target))
            assert held, "a follower's clone costs no more than the slot it gives back"
            self._park(r, decided)
        elif decided.now.kind == "donor":
            r.clone_upto = decided.now.upto
            engine.start_request(r, donor=(decided.now.donor, decided.now.upto))
        else:
            engine.start_request(r)

    def arrived(self, r: Request) -> None:
        """`r` has to wait for a slot: if it would follow a leader, it parks now (holding no slot)."""
        if self.enabled and r.named is None and self.engine.config.follow:
            decided = self._plan(r)
            adm = self.engine.adm
            if decided.follow and adm.hold(r, adm.clone_bytes(decided.target)):  # else it waits in the queue
                adm.queue.remove(r)
                self._park(r, decided)

    def _plan(self, r: Request) -> Plan:
        engine, config = self.engine, self.engine.config
        now = time.monotonic()
        cached = engine.adm.cache.best(r.prompt, r.req.scope)
        waited = now - r.first_parked_at if r.first_parked_at else 0.0
        policy = FollowPolicy(config.active_prefix_reuse_min_tokens, follow=config.follow and not r.no_follow,
                              max_wait_s=max(0.0, config.follow_max_wait - waited))
        prefilling = self.prefilling()
        decided = plan(Recipient(r.rid, r.prompt), self._leaders(r), cached, self.rates.rates, policy, prefilling)
        earlier = {k: v for k, v in r.decision.items() if k in ("clone_refused", "follow_expired")}
        r.decision = {**decided.log_fields(), **earlier}
        for key in ("donor", "leader"):  # name them as the client did
            other = engine.request(r.decision[key])
            r.decision[key] = other.req.request_id if other is not None else None
        engine.metrics.follow.inc(choice=decided.reason)
        r.cached_match = cached
        return decided

    def prefilling(self) -> int:
        return sum(1 for x in self.engine.requests()
                   if x.phase in (Phase.STARTING, Phase.RUNNING) and x.committed < len(x.prompt) and x.lead is None)

    def _leaders(self, r: Request) -> list[Leader]:
        rates = self.rates.rates
        # a leader prefills at its share of the rate; a follower does not compete with it
        tps = rates.share(self.prefilling())
        below = self._followers_below(r)
        scope = r.req.scope
        active = []
        for x in self.engine.requests():
            # a request on its way out gives nothing; another scope's never; a choice is its lead's twin
            if x is r or x.rid in below or x.ending or x.req.scope != scope or x.lead is not None:
                continue
            if x.phase is Phase.STARTING and x.clone_upto:  # holds [0, clone_upto) once its donor clone runs
                active.append(Leader.starting(Source.donor(x.rid, x.prompt, 0, x.rid), x.clone_upto,
                                              rates.clone_s(x.clone_upto), tps))
            elif x.phase in (Phase.STARTING, Phase.RUNNING):
                floor = window_floor(x.committed, self.windows)
                # A recurrent state serves its position and its checkpoints only (base.py's recurrent rule).
                positions = clone_positions(x.committed, self.info, x.kept) if self.recurrent else None
                active.append(Leader.active(Source.donor(x.rid, x.prompt, x.committed_prompt, x.rid,
                                                         clone_floor=floor, positions=positions), tps))
            elif x.landed is not None:  # holds it already, waiting for a slot
                active.append(Leader.starting(Source.donor(x.rid, x.prompt, 0, x.rid), x.landed[1], 0.0, tps))
        parked = [(f.following, Source.donor(f.rid, f.prompt, 0, f.rid)) for f in self.followers.values()
                  if f.following is not None and f.rid not in below and f is not r and f.req.scope == scope]
        return leader_views(active, parked, rates, tps)

    def _followers_below(self, r: Request) -> set[int]:
        """Everyone following `r`, directly or down a chain: never a leader for `r`."""
        below, grew = {r.rid}, True
        while grew:
            grew = False
            for f in self.followers.values():
                if f.rid not in below and f.leader in below:
                    below.add(f.rid)
                    grew = True
        return below - {r.rid}

    def _park(self, r: Request, decided: Plan) -> None:
        engine, now = self.engine, time.monotonic()
        r.phase = Phase.FOLLOWING
        r.first_parked_at = r.first_parked_at or now
        r.following = Following.park(r.rid, decided, r.rid, r.first_parked_at, engine.config.follow_max_wait)
        self.followers[r.rid] = r
        loop = asyncio.get_running_loop()
        r.follow_timer = loop.call_later(max(0.0, r.following.deadline - now), self._expired, r.rid)
        engine.expire_at(r, r.submitted_at + engine.config.queue_timeout)  # the same queue timeout as anyone
        lead = engine.request(r.following.leader)
        if lead is not None and lead.phase in (Phase.STARTING, Phase.RUNNING):
            self._register(r)

    def _register(self, f: Request) -> None:
        f.registered = True
        order = f.following
        assert order is not None
        self.engine.send(m.CloneDonor(f.rid, order.leader, order.target, order=order.order))

    def started(self, r: Request) -> None:
        """`r` was handed to the runner: the clone orders of its followers can go there now."""
        for f in self.followers.values():
            if f.leader == r.rid and not f.registered:
                self._register(f)

    # ---- outcomes ----

    def donor_started(self, r: Request, ev: m.Started) -> None:
        """`r` started from the donor clone its Start carried."""
        r.clone_upto = 0
        self.engine.metrics.clone("donor", [], True)
        self.observe_clone(ev.reused, ev.clone_s)
        r.reuse_source = "donor"
        self.engine.metrics.donor_saved.inc(max(0, ev.reused - r.cached_match))

    def clone_done(self, r: Request, ev: m.CloneDone) -> None:
        """A follower's clone order came back, or a donor start's clone was refused."""
        engine, metrics = self.engine, self.engine.metrics
        metrics.clone("donor", [ev.reason] if ev.session is None and ev.reason != "leader_gone" else [],
                      ev.session is not None)
        if ev.session is not None:
            self.observe_clone(ev.upto, ev.seconds)
            r.reuse_source = "donor"
            metrics.donor_saved.inc(max(0, ev.upto - r.cached_match))
        if r.clone_upto:  # its Start's donor clone was refused: the runner did not start it
            r.clone_upto = 0
            r.decision["clone_refused"] = ev.reason
            if r.ending:  # asked to end meanwhile: the runner holds nothing of it
                engine.complete(r, r.ending)
            else:
                engine.start_request(r)  # the normal path, with a fresh prefix cache lookup
            return
        r.registered = False  # the runner has dealt with its order
        self._unpark(r)
        if ev.session is not None:
            r.landed = (ev.session, ev.upto)  # its hold covers it (a heir's clone holds no more than asked)
        else:
            engine.adm.let_go(r)
            if ev.reason != "leader_gone":
                r.decision["clone_refused"] = ev.reason
                r.no_follow = True  # clone-now from here on
        engine.adm.requeue(r)

    def gone(self, r: Request) -> None:
        """`r` is done on the loop: a parked `r` abandons its order; requests parked behind it plan again.
        (A clone-now request ends only once the runner answered its Start: its clone is its own session.)"""
        if self.followers.pop(r.rid, None) is not None:
            self._stop_following(r)
        orphans = [f for f in self.followers.values() if f.leader == r.rid and not f.registered]
        for f in orphans:  # back to the queue, in arrival order: they plan again when admitted
            self._unpark(f)
            self.engine.adm.let_go(f)
            self.engine.adm.requeue(f)

    def _expired(self, rid: int) -> None:
        f = self.followers.get(rid)
        if f is None:
            return
        self._unpark(f)
        f.decision["follow_expired"] = True
        f.no_follow = True
        self.engine.adm.let_go(f)
        self.engine.adm.requeue(f)
        self.engine.admit()

    def _unpark(self, f: Request) -> None:
        self.followers.pop(f.rid, None)
        self._stop_following(f)
        f.phase = Phase.QUEUED

    def _stop_following(self, f: Request) -> None:
        if f.follow_timer is not None:
            f.follow_timer.cancel()
        if f.registered and f.phase is Phase.FOLLOWING and f.following is not None:
            # the runner may have made the clone already: its bytes stay held until the order is answered
            self.engine.adm.abandon_clone(f, self.engine.adm.clone_bytes(f.following.target))
            self.engine.send(m.Cancel(f.rid))  # drops its clone order
        f.following, f.registered = None, False

    # ---- measured rates, for the cost model ----

    def step(self, stats: m.StepStats) -> None:
        self.rates = self.rates.observe_prefill(stats.prefill_tokens, stats.prefill_s)

    def observe_clone(self, tokens: int, seconds: float) -> None:
        self.rates = self.rates.observe_clone(tokens, seconds)
