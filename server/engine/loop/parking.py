"""The parked phases, Following and Restoring: a request that waits for a session to be handed to it,
holding the bytes of that session and no slot (request.py), and the runner's answers that end the wait.

A part of `Serving` (serving.py) that owns the followers (the requests parked behind a leader), built with what
else it reads and writes: the request table (read), Admission, the ledger, the disk tier, the runner's queue (`send`),
the metrics, the shared rates, Progress (a donor's clone observed), and `loop`, the few verbs of the state machine it
calls back (`Loop`). Its surface: `follow`, `read_from_disk`, `leader_started`, `unpark`, `abandon`, `leader_left`,
the runner's answers `on_clone_done` and `on_state_loaded`, and what it holds (`followers`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Protocol

from kvfork.server.engine import messages as m
from kvfork.server.engine.cache.disk import DiskTier
from kvfork.server.engine.policy.entries import Match
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop import request as phase
from kvfork.server.engine.loop.admission import Admission
from kvfork.server.engine.loop.ledger import LoopLedger
from kvfork.server.engine.loop.placing import prefilling
from kvfork.server.engine.loop.progress import Progress
from kvfork.server.engine.loop.request import Following, Landed, Prefilling, Queued, Request, Restoring
from kvfork.server.engine.loop.telemetry import EngineMetrics
from kvfork.server.engine.policy.follow import FollowOrder, at_deadline
from kvfork.server.engine.policy.placement import Follow
from kvfork.server.engine.policy.rates import LiveRates


class Loop(Protocol):
    """What parking asks of the state machine (serving.Serving) when a parked request moves on."""

    def admit(self) -> None: ...

    def complete(self, r: Request, reason: str) -> None: ...

    def start(self, r: Request, cached: int = 0, *, candidates: list | None = None) -> None: ...

    def expire_at(self, r: Request, deadline: float) -> None: ...

    def cached_matches(self, r: Request) -> list[Match]: ...

    def reuse_failed(self, stage: str, exc: Exception) -> None: ...


class Parking:
    def __init__(self, requests: dict[int, Request], admission: Admission, ledger: LoopLedger, disk: DiskTier | None,
                 send: Callable[[Any], None], config: EngineConfig, metrics: EngineMetrics, rates: LiveRates,
                 progress: Progress, loop: Loop):
        """`requests`: the state machine's table of requests, by id (read, never changed here)."""
        self._requests, self._admission, self._ledger, self._disk = requests, admission, ledger, disk
        self._send = send
        self._config, self._metrics, self._rates, self._progress, self._loop = config, metrics, rates, progress, loop
        self._followers: dict[int, Request] = {}  # parked behind a leader, in park order

    @property
    def followers(self) -> list[Request]:
        """The requests parked behind a leader, in park order (read, never changed)."""
        return list(self._followers.values())

    # ---- following a leader ----

    def follow(self, r: Request, p: Follow) -> None:
        """Park `r` behind `p.leader`, holding the bytes of the clone it will be handed and no slot."""
        adm = self._admission
        if adm.in_slot(r):  # placed at admission: its slot goes back
            adm.leave_slot(r)
            held = adm.reserve(r, adm.clone_bytes(p.target))
            assert held, "a follower's clone costs no more than the slot it gives back"
        elif not adm.reserve(r, adm.clone_bytes(p.target)):  # on arrival: it waits in the queue instead
            return
        adm.withdraw(r)
        now = time.monotonic()
        first = r.tried.first_parked_at or now
        order = FollowOrder.park(r.rid, p.decided, r.rid, first, self._config.follow_max_wait)
        leader = self._requests.get(order.leader)  # type: ignore[call-overload]  # the loop's leaders are rids
        following = phase.follow(r, order, p.cached, now, leader.committed_prompt if leader is not None else 0)
        self._followers[r.rid] = r
        loop = asyncio.get_running_loop()
        following.timer = loop.call_later(max(0.0, order.deadline - now), self._follow_expired, r.rid)
        self._loop.expire_at(r, r.submitted_at + self._config.queue_timeout)  # the same queue timeout as anyone
        if leader is not None and leader.holds_slot:
            self._register(r)

    def leader_started(self, leader: int) -> None:
        """`leader` went to the runner: the clone orders of its followers can go there now."""
        for f in self._followers.values():
            if isinstance(f.phase, Following) and f.phase.order.leader == leader and not f.phase.registered:
                self._register(f)

    def _register(self, f: Request) -> None:
        assert isinstance(f.phase, Following)
        f.phase.registered = True
        order = f.phase.order
        self._send(m.CloneDonor(f.rid, order.leader, order.target, order=order.order))  # type: ignore[arg-type]

    def _follow_expired(self, rid: int) -> None:
        f = self._followers.get(rid)
        if f is None or self._still_following(f):
            return
        self.unpark(f)
        f.decision["follow_expired"] = True
        f.tried.no_follow = True
        self._requeue(f)
        self._loop.admit()

    def _still_following(self, f: Request) -> bool:
        """At `f`'s deadline: whether following its (running) leader is still the cheaper way, by the
        leader's progress since `f` last looked (follow.at_deadline); if so the timer is armed again."""
        following = f.phase
        assert isinstance(following, Following)
        leader = self._requests.get(following.order.leader)  # type: ignore[call-overload]
        if leader is None or not leader.holds_slot:
            return False  # a parked leader (a chain) or one on its way: plan again
        now, (seen_at, seen) = time.monotonic(), following.seen
        committed = leader.committed_prompt
        progress = (committed - seen) / (now - seen_at) if now > seen_at else 0.0
        decided = at_deadline(len(f.prompt), following.order.target, committed, progress,
                              self._rates.tracker.rates, prefilling(self._requests.values()),
                              self._config.follow_max_wait)
        f.decision.update(follow_extended=decided.keep, ttft_follow_left_s=round(decided.ttft_follow_s, 4),
                          ttft_clone_now_s=round(decided.ttft_now_s, 4))
        if not decided.keep:
            return False
        following.seen = now, committed
        following.timer = asyncio.get_running_loop().call_later(decided.recheck_s, self._follow_expired, f.rid)
        return True

    def unpark(self, f: Request, landed: Landed | None = None, answered: bool = False) -> None:
        """Back to the queue's phase. Unless the runner `answered` its order, the order is dropped (a clone
        made meanwhile comes back to nobody and is released: its bytes stay held until then)."""
        self._followers.pop(f.rid, None)
        following = f.phase
        assert isinstance(following, Following)
        if following.timer is not None:
            following.timer.cancel()
        if following.registered and not answered:
            self.abandon(f, self._admission.clone_bytes(following.order.target))
            self._send(m.Cancel(f.rid))  # drops its clone order
        phase.queue(f, landed)

    def abandon(self, r: Request, nbytes: int) -> None:
        """`r` stops waiting for a session of `nbytes` it ordered from the runner (a clone, a state load): those
        bytes move from its hold to the ledger's abandoned orders, held until the runner answers the order."""
        adm = self._admission
        nbytes = min(nbytes, adm.holds(r))
        adm.reserve(r, adm.holds(r) - nbytes)  # less: it always fits
        self._ledger.abandon(r.rid, nbytes)

    def _requeue(self, r: Request) -> None:
        """Back in the queue at its arrival place, holding nothing (or only its landed session)."""
        if not (isinstance(r.phase, Queued) and r.phase.landed is not None):
            self._admission.let_go(r)
        self._admission.requeue(r)

    def leader_left(self, r: Request) -> None:
        """Requests parked on `r` whose order never reached the runner plan again from the queue."""
        orphans = [f for f in self._followers.values()
                   if isinstance(f.phase, Following) and f.phase.order.leader == r.rid and not f.phase.registered]
        for f in orphans:  # back to the queue, in arrival order: they plan again when admitted
            self.unpark(f)
            self._requeue(f)

    # ---- restoring from the disk tier ----

    def read_from_disk(self, r: Request, match: Any) -> None:
        """Park `r`, holding the bytes of the session it will be handed and no slot, while the disk
        thread reads and checks the file; the runner then loads it."""
        adm, disk = self._admission, self._disk
        assert disk is not None  # a Restore is placed only with the tier on
        adm.leave_slot(r)
        held = adm.reserve(r, adm.clone_bytes(match.upto))  # the session it will be handed, before it exists
        assert held, "a restored session costs no more than the slot it gives back"
        phase.restore(r, match)
        disk.touch(match.entry)
        self._loop.expire_at(r, r.submitted_at + self._config.queue_timeout)
        disk.read(match.entry, lambda state, outcome, s: self._on_disk_read(r.rid, match, state, outcome, s))

    def _on_disk_read(self, rid: int, match: Any, state: Any, outcome: str, seconds: float) -> None:
        """The disk thread read `match`'s file (state None: it was bad, and is gone)."""
        r = self._requests.get(rid)
        if r is None or not isinstance(r.phase, Restoring) or r.phase.match is not match:
            return  # it left meanwhile
        if state is not None:
            self._rates.tracker = self._rates.tracker.observe_read(match.entry.nbytes, seconds)
            try:
                state = state.prefix(match.upto)
            except Exception as exc:  # the lookup's rules admit it; a file that disagrees is dropped, r prefills
                self._disk.forget(match.entry)  # type: ignore[union-attr]
                self._loop.reuse_failed("disk", exc)
                state, outcome = None, "corrupt"
        if state is None:
            self._metrics.disk_restores.inc(outcome=outcome)
            r.decision["disk"] = outcome
            self._stop_restoring(r)
            self._loop.admit()
            return
        r.phase.sent = True
        self._send(m.LoadState(rid, state))

    def _stop_restoring(self, r: Request, landed: Landed | None = None) -> None:
        if landed is None:
            r.tried.no_disk = True
        phase.queue(r, landed)
        self._requeue(r)

    # ---- the runner's answers to a parked request ----

    def on_clone_done(self, ev: m.CloneDone) -> None:
        """A follower's clone order came back, or a donor start's clone was refused."""
        r = self._requests.get(ev.rid)
        # the answer to an order its request stopped waiting for (it left, or its follow timed out)
        waits = r is not None and (isinstance(r.phase, Following) or
                                   (isinstance(r.phase, Prefilling) and r.phase.donor_upto > 0))
        if self._ledger.answered(ev.rid) or not waits:
            self._admission.release_sessions([ev.sid] if ev.sid is not None else [])
            return
        assert r is not None
        cached = r.phase.cached  # type: ignore[union-attr]
        if ev.sid is not None:
            self._progress.observe_clone("donor", [], ev.upto, ev.seconds, r, cached)
        else:
            self._metrics.clone("donor", [ev.reason] if ev.reason != "leader_gone" else [], False)
        if isinstance(r.phase, Prefilling):  # its Start's donor clone was refused: the runner did not start it
            r.decision["clone_refused"] = ev.reason
            for sibling in r.siblings:  # the runner dropped the choices that Start carried: they go with the next
                sibling.sent = False
            if r.ending:  # asked to end meanwhile: the runner holds nothing of it
                self._loop.complete(r, r.ending)
            else:
                self._loop.start(r, cached, candidates=self._loop.cached_matches(r))
            return
        landed = Landed(ev.sid, ev.upto) if ev.sid is not None else None  # its hold covers it
        if landed is None and ev.reason != "leader_gone":
            r.decision["clone_refused"] = ev.reason
            r.tried.no_follow = True  # clone-now from here on
        self.unpark(r, landed, answered=True)
        self._requeue(r)

    def on_state_loaded(self, ev: m.StateLoaded) -> None:
        """The runner loaded a request's state (or failed to): it waits for a slot, or prefills."""
        r = self._requests.get(ev.rid)
        # the answer to a load its request stopped waiting for
        if self._ledger.answered(ev.rid) or r is None or not isinstance(r.phase, Restoring):
            self._admission.release_sessions([ev.sid] if ev.sid is not None else [])
            return
        outcome = "restored" if ev.sid is not None else "failed"
        self._metrics.disk_restores.inc(outcome=outcome)
        if ev.sid is None:  # loading it raised: never served again
            self._disk.forget(r.phase.match.entry)  # type: ignore[union-attr]
            self._metrics.reuse_errors.inc(stage="disk")  # the runner logged why
            r.decision["disk"] = outcome
            self._stop_restoring(r)
            return
        r.reuse_source = "disk"
        self._stop_restoring(r, Landed(ev.sid, ev.upto))  # its hold covers it

