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

The disk tier (disk.py) comes last: when a file of the request's scope serves
more of its prompt than anything in memory, and the cost model (restore.py)
expects reading it to beat computing it, the request parks without a slot
(RESTORING), holding the bytes of the session it will be handed, while the disk
thread reads and checks the file; the runner loads it into a session, and the
request then takes the next free slot like a follower whose clone landed. A
file that fails its check, or a load that fails, sends it back to prefill.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Iterable, Protocol

from backends.base import ModelInfo, clone_positions
from server.engine import messages as m
from server.engine.disk import DiskMatch
from server.engine.follow import FollowPolicy, Following, Leader, Plan, at_deadline, leader_views, plan
from server.engine.matching import Recipient, Source, window_floor
from server.engine.rates import RateTracker
from server.engine.request import Phase, Request
from server.engine.restore import choose_restore

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
        if r.named is not None:
            engine.start_request(r)
            return
        if not self.enabled:
            if not self._restore(r, engine.adm.cache.best(r.prompt, r.req.scope)):
                engine.start_request(r)
            return
        decided = self._plan(r)
        if self._restore(r, decided.target if decided.follow else decided.now.upto):
            return
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
        r.follow_seen = now, lead.committed_prompt if lead is not None else 0
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

    # ---- the disk tier ----

    def _restore(self, r: Request, memory: int) -> bool:
        """Park `r` to restore its prefix from disk, when a file serves more than `memory` (the best
        match in memory) and the cost model expects that to be faster. False: it goes on without."""
        engine = self.engine
        adm, disk = engine.adm, engine.adm.disk
        if disk is None or not disk.on or r.no_disk or r.siblings:
            return False
        matches = disk.lookup(r.prompt, r.req.scope)
        if not matches or matches[0].upto <= memory or matches[0].upto < engine.config.prefix_cache_min_tokens:
            return False
        match = matches[0]
        choice = choose_restore(match.upto, match.entry.file_bytes, memory, self.rates.rates, self.prefilling())
        r.decision.update(choice.log_fields())
        engine.metrics.disk_decisions.inc(choice=choice.reason)
        if not choice.restore:
            return False
        adm.free_slot(r)
        adm.free_capture_slot(r)
        held = adm.hold(r, adm.clone_bytes(match.upto))  # the session it will be handed, before it exists
        assert held, "a restored session costs no more than the slot it gives back"
        r.phase, r.restoring = Phase.RESTORING, match
        disk.touch(match.entry)
        engine.expire_at(r, r.submitted_at + engine.config.queue_timeout)
        disk.read(match.entry, lambda state, outcome, seconds: self._read(r.rid, match, state, outcome, seconds))
        return True

    def _read(self, rid: int, match: DiskMatch, state: Any, outcome: str, seconds: float) -> None:
        """The disk thread read `match`'s file (state None: it was bad, and is gone)."""
        engine = self.engine
        r = engine.request(rid)
        if r is None or r.phase is not Phase.RESTORING or r.restoring is not match:
            return  # it left meanwhile
        if state is not None:
            self.rates = self.rates.observe_read(match.entry.file_bytes, seconds)
            try:
                state = state.prefix(match.upto)
            except Exception:  # the lookup's rules admit it; a file that disagrees prefills
                state, outcome = None, "corrupt"
        if state is None:
            engine.metrics.disk_restores.inc(outcome=outcome)
            r.decision["disk"] = outcome
            self._stop_restoring(r)
            engine.admit()
            return
        r.restore_sent = True
        engine.send(m.Restore(rid, state))

    def restored(self, r: Request, ev: m.Restored) -> None:
        """The runner loaded `r`'s state (or failed to): it waits for a slot, or prefills."""
        outcome = "restored" if ev.session is not None else "failed"
        self.engine.metrics.disk_restores.inc(outcome=outcome)
        if ev.session is None:
            r.decision["disk"] = outcome
            self._stop_restoring(r)
            return
        r.restoring, r.restore_sent, r.phase = None, False, Phase.QUEUED
        r.landed, r.reuse_source = (ev.session, ev.upto), "disk"  # its hold covers it
        self.engine.adm.requeue(r)

    def _stop_restoring(self, r: Request) -> None:
        r.restoring, r.restore_sent, r.phase, r.no_disk = None, False, Phase.QUEUED, True
        self.engine.adm.let_go(r)
        self.engine.adm.requeue(r)

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
        if r.phase is Phase.RESTORING and r.restore_sent:  # the runner may have loaded it already
            self.engine.adm.abandon_clone(r, self.engine.adm.clone_bytes(r.restoring.upto))
        orphans = [f for f in self.followers.values() if f.leader == r.rid and not f.registered]
        for f in orphans:  # back to the queue, in arrival order: they plan again when admitted
            self._unpark(f)
            self.engine.adm.let_go(f)
            self.engine.adm.requeue(f)

    def _expired(self, rid: int) -> None:
        f = self.followers.get(rid)
        if f is None:
            return
        if self._still_following(f):
            return
        self._unpark(f)
        f.decision["follow_expired"] = True
        f.no_follow = True
        self.engine.adm.let_go(f)
        self.engine.adm.requeue(f)
        self.engine.admit()

    def _still_following(self, f: Request) -> bool:
        """At `f`'s deadline: whether following its (running) leader is still the cheaper way, by the
        leader's progress since `f` last looked; if so the timer is armed again."""
        engine, order = self.engine, f.following
        lead = engine.request(order.leader) if order is not None else None
        if order is None or lead is None or lead.phase not in (Phase.STARTING, Phase.RUNNING):
            return False  # a parked leader (a chain) or one on its way: plan again
        now, (seen_at, seen) = time.monotonic(), f.follow_seen
        progress = (lead.committed_prompt - seen) / (now - seen_at) if now > seen_at else 0.0
        decided = at_deadline(len(f.prompt), order.target, lead.committed_prompt, progress, self.rates.rates,
                              self.prefilling(), engine.config.follow_max_wait)
        f.decision.update(follow_extended=decided.keep, ttft_follow_left_s=round(decided.ttft_follow_s, 4),
                          ttft_clone_now_s=round(decided.ttft_now_s, 4))
        if not decided.keep:
            return False
        f.follow_seen = now, lead.committed_prompt
        f.follow_timer = asyncio.get_running_loop().call_later(decided.recheck_s, self._expired, f.rid)
        return True

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
