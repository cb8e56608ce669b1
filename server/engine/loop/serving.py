"""The engine's state machine over requests, built once the model has loaded (engine.py builds it from the
runner's Loaded event; before that the engine serves nothing): its managers exist from the start.

A request's path: `submit_choices` checks it (Admission.check) and queues it; `admit` gives the queue's
head a slot (or pauses a request of a tenant above its share for one below it); `_place` asks
placement.place where it starts and `_apply` does it: a Start to the runner, or a park (following a leader,
restoring from disk: parking.py) that comes back to the queue. The runner's events (`handle`) move it
through its phases (request.py): the handlers are grouped by the phases they move, in parking.py
(Following, Restoring), progress.py (Prefilling, Decoding, Paused) and ending.py (Finished).
It never calls the backend and never blocks: commands go to the runner thread through `send`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any, Callable

from kvfork.backends.base import ModelInfo
from kvfork.server.engine import messages as m
from kvfork.server.engine.api import CapacityExhausted, GenerateRequest, choice_sampling
from kvfork.server.engine.cache.disk import DiskTier
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.policy.entries import Match
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop import request as phase
from kvfork.server.engine.loop.admission import Admission
from kvfork.server.engine.loop.ending import Ending
from kvfork.server.engine.loop.ledger import LoopLedger
from kvfork.server.engine.loop.parking import Parking
from kvfork.server.engine.loop.placing import take_view
from kvfork.server.engine.policy.placement import (Cached, CloneRunning, Follow, Fresh, Placement, Restore, Resume, View, Wait,
                                            place, place_without_reuse)
from kvfork.server.engine.cache.sessions import NamedSessions
from kvfork.server.engine.loop.progress import Progress
from kvfork.server.engine.loop.request import Following, Paused, Queued, Request, RequestHandle
from kvfork.server.engine.loop.stats import EngineStats
from kvfork.server.engine.loop.telemetry import EngineMetrics
from kvfork.server.engine.policy.rates import LiveRates

log = logging.getLogger("kvfork.engine")


class Serving:
    def __init__(self, config: EngineConfig, info: ModelInfo, index: Index, disk: DiskTier | None,
                 send: Callable[[Any], None], metrics: EngineMetrics, rates: LiveRates):
        """`config` resolved for the loaded model; `disk`: the prefix cache's disk tier, None when it is off;
        `rates`: the cost model's, which its parts observe into."""
        self.config, self.info, self.metrics, self._rates = config, info, metrics, rates
        self._send = send
        self._index, self._disk = index, disk
        self._named = NamedSessions(config.max_named_sessions, index)
        self._ledger = LoopLedger()  # the runner's bytes, as its reports and the loop's orders give them
        self._admission = Admission(config, info, index, self._named, disk, send, self._ledger)
        self.closing = False  # shutting down: nothing more is admitted
        self.idle = asyncio.Event()  # set while it holds no request
        self.idle.set()
        self._requests: dict[int, Request] = {}
        self._reuse_errors_logged: set[tuple[str, str]] = set()  # (stage, exception type) logged once
        self._next_rid = 0
        self._progress = Progress(self._requests, self._admission, index, self._ledger, disk, config, metrics, rates,
                                  self.admit)
        self._parking = Parking(self._requests, self._admission, self._ledger, disk, send, config, metrics, rates,
                                self._progress, self)
        self._ending = Ending(self._requests, self._admission, index, self._named, self._parking, self._progress,
                              send, config, metrics, self.admit, self.idle)
        p, parked = self._progress, self._parking
        self._handlers: dict[type, Callable[[Any], None]] = {
            m.Started: p.on_started, m.Token: p.on_token, m.Captured: p.on_captured, m.Exported: p.on_exported,
            m.Ledger: p.on_ledger, m.StepStats: p.on_step_stats,
            m.CloneDone: parked.on_clone_done, m.StateLoaded: parked.on_state_loaded,
            m.Ended: self._ending.on_ended,
        }

    # ---- what the engine reads ----

    @property
    def admission(self) -> Admission:
        return self._admission

    @property
    def index(self) -> Index:
        return self._index

    @property
    def named(self) -> NamedSessions:
        return self._named

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    @property
    def following(self) -> int:
        return len(self._parking.followers)

    def requests(self) -> list[Request]:
        """The requests it holds now, in admission order (read, never changed)."""
        return list(self._requests.values())

    def stats(self) -> EngineStats:
        adm, ledger, index, named, disk = self._admission, self._ledger, self._index, self._named, self._disk
        runner = ledger.runner
        return EngineStats(
            loaded=True, budget=adm.budget, held=adm.held(), reserved=adm.reserved, pooled=ledger.pooled,
            in_transit=ledger.in_transit, spilling=ledger.spilling, abandoned=ledger.abandoned,
            live_sessions=runner.live_sessions, total_bytes=runner.total_bytes, blocks=runner.blocks,
            slots_used=adm.slots_used, queued=adm.queued, paused=adm.paused, following=self.following,
            captures_in_use=adm.captures_in_use, cached=index.count("memory"), cached_bytes=index.nbytes("memory"),
            on_disk=index.count("disk"), disk_bytes=disk.nbytes if disk is not None else 0,
            disk_spilled=disk.stats.spilled if disk is not None else 0,
            disk_corrupt=disk.stats.corrupt if disk is not None else 0, disk_on=disk is not None and disk.on, named_sessions=len(named),
            named_holding=named.holding())

    # ---- requests ----

    def submit_choices(self, req: GenerateRequest) -> list[RequestHandle]:
        """`req.n` choices over one prompt, admitted together; choice 0 prefills it (and is the request
        reuse sees), the others start from clones of it (runner.py)."""
        adm = self._admission
        if self.waiting() >= self.config.max_queue and (victim := adm.give_way(req.scope.tenant)) is not None:
            self._ending.complete(victim, "error", "turned away from a full queue for another tenant's request: this "
                          "tenant holds more than its share of --max-queue", gave_way=True)
        sizes = adm.check(req, waiting=self.waiting())
        named = None
        if req.session_id is not None:  # a busy session gives None: the request runs without it
            named, evicted = self._named.acquire(req.session_id, req.scope.tenant)
            adm.release_sessions(*evicted)
        eos = frozenset() if req.ignore_eos else frozenset(self.info.eos_token_ids)
        r = self._new_request(req, sizes.max_tokens, req.stop_token_ids | eos, sizes.need, named=named)
        r.tried.no_follow = req.n > 1  # its choices hold their slots from admission: it clones now or prefills
        for i in range(1, req.n):
            choice = replace(req, sampling=choice_sampling(req.sampling, i), n=1)
            r.siblings.append(self._new_request(choice, sizes.max_tokens, r.stop_ids, sizes.choice_need, parent=r))
        if named is not None and named.state is not None:
            adm.take_named(r, named.state.nbytes)
        self.idle.clear()
        adm.enqueue(r)
        self.admit()
        if isinstance(r.phase, Queued):
            self.expire_at(r, r.submitted_at + self.config.queue_timeout)
            self._arrive(r)
        if isinstance(r.phase, Following) and not adm.can_wait(self.waiting() - 1):
            # A follower waits like a queued request: it counts against --max-queue when it parks.
            self._ending.withdraw(r)
            raise CapacityExhausted(f"{self.waiting()} requests are already waiting")
        return [r.handle] + [s.handle for s in r.siblings]

    def _new_request(self, req: GenerateRequest, max_tokens: int, stop_ids: frozenset[int], need: int,
                     **kw: Any) -> Request:
        self._next_rid += 1
        rid = self._next_rid
        handle = RequestHandle(req.request_id, lambda: self._ending.cancel(rid), lambda: self._ending.finish(rid))
        r = self._requests[rid] = Request(rid, req, handle, max_tokens, stop_ids, need, **kw)
        return r

    def cancel(self, rid: int) -> None:
        """Cancel request `rid`, wherever it is (ending.py)."""
        self._ending.cancel(rid)

    def complete(self, r: Request, reason: str, error: str | None = None) -> None:
        """End `r` now with `reason`, and give back everything it holds (ending.py)."""
        self._ending.complete(r, reason, error)

    def waiting(self) -> int:
        """Requests waiting: queued, and parked behind a leader."""
        return self._admission.queued + self.following

    def drop_session(self, session_id: str, forget: bool, tenant: str) -> bool:
        """Reset (forget False: it starts cold next time) or delete a named session; False: none such."""
        existed, held = self._named.drop(session_id, forget, tenant)
        self._admission.release_sessions(*held)
        return existed

    # ---- admission and placement ----

    def admit(self) -> None:
        """Give free slots to the queue's head while its bytes fit; each admitted request is placed, a paused
        one decodes on. Then, while no slot is free for a tenant below its share, a tenant above its own
        pauses a request for it (Admission.to_pause), and the slot is given again."""
        adm = self._admission
        if self.closing:
            return
        self._admit_free()
        while (paused := adm.to_pause()) is not None:
            phase.pause(paused)
            adm.pause(paused)
            self._send(m.Pause(paused.rid))
            self.metrics.preemptions.inc()
            self._admit_free()

    def _admit_free(self) -> None:
        adm = self._admission
        while (r := adm.next()) is not None:
            if isinstance(r.phase, Paused):
                phase.resume(r)
                self._send(m.Unpause(r.rid))
                continue
            if r.expiry is not None:
                r.expiry.cancel()
            r.admitted_at = time.monotonic()
            self.metrics.queue_wait.observe(r.admitted_at - r.submitted_at)
            if not adm.has_capture(r) and self._index.worth_capturing(len(r.prompt)):
                self.metrics.captures.inc(outcome="skipped")
            for sibling in r.waiting_siblings:  # they hold their slots now, and go to the runner with r's Start
                phase.prefill(sibling)
                sibling.admitted_at = r.admitted_at
            self._apply(r, self._place(r, slot=True))

    def _arrive(self, r: Request) -> None:
        """`r` has to wait for a slot: if it would follow a leader, it parks now (holding no slot)."""
        if self.config.active_prefix_reuse_min_tokens > 0 and r.named is None and self.config.follow:
            self._apply(r, self._place(r, slot=False))

    def _place(self, r: Request, slot: bool) -> Placement:
        """Where `r` starts: placement.place over its view. Reuse is optional work: a lookup or a choice
        that raises is logged and counted, and `r` starts from a fresh prefill (or waits for its slot)."""
        try:
            return place(r, self._view(r, slot))
        except Exception as exc:
            self.reuse_failed("placement", exc)
            return place_without_reuse(r, slot)

    def cached_matches(self, r: Request) -> list[Match]:
        """The prefix cache's matches for `r`'s prompt, best first; none when the lookup raises."""
        try:
            return self._index.best(r.prompt, r.req.scope, disk=False).memory
        except Exception as exc:
            self.reuse_failed("placement", exc)
            return []

    def reuse_failed(self, stage: str, exc: Exception) -> None:
        """Counted each time; logged with its traceback the first time each stage fails this way."""
        self.metrics.reuse_errors.inc(stage=stage)
        seen = (stage, type(exc).__name__)
        if seen not in self._reuse_errors_logged:
            self._reuse_errors_logged.add(seen)
            log.error("reuse failed (%s); the request prefills instead", stage, exc_info=exc)

    def _view(self, r: Request, slot: bool) -> View:
        disk = self._disk is not None and self._disk.on
        return take_view(r, self._requests.values(), self._parking.followers, self._index,
                         self._rates.tracker.rates, self.config, disk, slot, time.monotonic())

    def _apply(self, r: Request, p: Placement) -> None:
        """Do what `place` decided for `r` (which holds a slot, unless it is a Wait or a Follow on arrival)."""
        if p.log is not None:
            r.decision = p.log
        if p.follow_choice is not None:
            self.metrics.follow.inc(choice=p.follow_choice)
        if p.disk_choice is not None:
            self.metrics.disk_decisions.inc(choice=p.disk_choice)
        match p:
            case Resume(sid=sid, upto=upto, named=named):
                if named:  # the request owns its state now; it comes back at the end
                    self._named.take(r.named)  # type: ignore[arg-type]  # placed as named: it has one
                self.start(r, p.cached, resume=(sid, upto))
            case CloneRunning(donor=donor, upto=upto):
                self.start(r, p.cached, donor=(donor, upto))
            case Cached(matches=matches):
                self.start(r, p.cached, candidates=list(matches))
            case Fresh():
                if r.named is not None:  # a named session that does not resume starts cold
                    self._admission.release_sessions(*self._named.take(r.named))
                self.start(r, p.cached)
            case Follow():
                self._parking.follow(r, p)
            case Restore(match=match):
                self._parking.read_from_disk(r, match)
            case Wait():
                pass

    def start(self, r: Request, cached: int = 0, resume: tuple[int, int] | None = None,
               donor: tuple[int, int] | None = None, candidates: list | None = None) -> None:
        """Hand `r`, which holds a slot, to the runner."""
        adm = self._admission
        phase.prefill(r, cached, donor[1] if donor else 0, candidates)
        for sibling in r.waiting_siblings:
            if sibling.ending:  # a choice that left while its Start was refused leaves now
                self.complete(sibling, sibling.ending)
        choices = [m.Choice(s.rid, s.req.sampling) for s in r.waiting_siblings]
        sid, at = resume if resume is not None else (None, 0)
        self._send(m.Start(r.rid, r.prompt, r.req.sampling, r.max_tokens, r.stop_ids, capture=adm.has_capture(r),
                           keep_session=r.named is not None, resume=sid, resume_at=at,
                           clone_from=[(c.entry.sid, c.upto) for c in candidates or ()], donor=donor,
                           constraint=r.req.constraint, choices=choices, keep_at=adm.checkpoints(r.req),
                           scope=json.dumps([r.req.scope.tenant, r.req.scope.salt]), images=r.req.images))
        for sibling in r.waiting_siblings:
            sibling.sent = True
        self._index.run(r.rid, r.prompt, r.req.scope, r.rid)
        self._parking.leader_started(r.rid)

    def expire_at(self, r: Request, deadline: float) -> None:
        """(Re)arm the queue timeout of a waiting request, at `deadline` on the monotonic clock."""
        if r.expiry is not None:
            r.expiry.cancel()
        loop = asyncio.get_running_loop()
        r.expiry = loop.call_later(max(0.0, deadline - time.monotonic()), self._ending.expire, r.rid)


    # ---- the runner's events ----

    def handle(self, event: Any) -> None:
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"unknown runner event {event!r}")
        handler(event)
