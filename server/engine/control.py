"""The control loop's side of the engine: request phases, runner events, streams.

Everything here runs on the asyncio loop and never blocks: it reacts to what the
daemon asks (cancel, finish) and to what the runner reports (started, tokens,
captures, clones, finished, step stats), and moves each request through its
phases (request.py) until its one DoneEvent is delivered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from backends.base import Backend, ModelInfo
from server.engine import messages as m
from server.engine.admission import Admission
from server.engine.api import DoneEvent, TokenEvent
from server.engine.config import EngineConfig
from server.engine.request import Phase, Request
from server.engine.reuse import Reuse
from server.engine.runner import Runner
from server.engine.telemetry import EngineMetrics


class Control:
    backend: Backend
    config: EngineConfig
    info: ModelInfo | None
    dead: bool
    metrics: EngineMetrics
    reuse: Reuse | None
    stats: m.StepStats
    _closing: bool
    _runner: Runner | None
    _loaded: asyncio.Future | None
    _loop: asyncio.AbstractEventLoop
    _admission: Admission | None
    _requests: dict[int, Request]
    _idle: asyncio.Event

    # Set once the model is loaded; nothing below runs before that.
    @property
    def adm(self) -> Admission:
        assert self._admission is not None
        return self._admission

    @property
    def runner(self) -> Runner:
        assert self._runner is not None
        return self._runner

    @property
    def reuser(self) -> Reuse:
        assert self.reuse is not None
        return self.reuse

    def _cancel(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending == "cancelled":
            return
        r.ending = "cancelled"
        if r.phase in (Phase.STARTING, Phase.RUNNING):
            self.runner.send(m.Cancel(rid))
        else:  # the runner holds nothing of it (a pending clone comes back to nobody and is released)
            self._complete(r, "cancelled")
            self._admit()

    def _finish(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending:
            return
        r.ending = "stop"
        if r.phase in (Phase.STARTING, Phase.RUNNING):
            self.runner.send(m.Finish(rid))
        else:
            self._complete(r, "stop")

    def _expire(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is not None and r.phase in (Phase.QUEUED, Phase.FOLLOWING):
            self._complete(r, "error", f"waited longer than --queue-timeout ({self.config.queue_timeout:g} s)")

    # ---- admission ----

    def _admit(self) -> None:
        adm = self._admission
        if adm is None or self._closing:
            return
        while (r := adm.next()) is not None:
            if r.expiry is not None:
                r.expiry.cancel()
            r.admitted_at = time.monotonic()
            self.metrics.queue_wait.observe(r.admitted_at - r.submitted_at)
            if not r.capture_slot and adm.cache.worth_capturing(len(r.prompt)):
                self.metrics.captures.inc(outcome="skipped")
            self.reuser.place(r)

    def _start(self, r: Request, **source: Any) -> None:
        r.phase = Phase.STARTING
        self.runner.send(self.adm.start(r, **source))
        self.reuser.started(r)

    def _complete(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.phase is Phase.DONE:
            return
        adm = self._admission
        if adm is not None:
            if r.holds_slot:
                adm.free_slot(r)
            adm.free_capture_slot(r)
            if r.phase is Phase.QUEUED and r in adm.queue:
                adm.queue.remove(r)
            if r.named is not None and r.named.busy:
                adm.named.release(r.named.name, r.named.session, r.named.tokens)
            if r.landed is not None:
                adm.release_sessions([r.landed[0]])
        if self.reuse is not None:
            self.reuse.gone(r)
        if r.expiry is not None:
            r.expiry.cancel()
        r.phase = Phase.DONE
        del self._requests[r.rid]
        event = DoneEvent(reason, r.usage(time.monotonic()), error)  # type: ignore[arg-type]
        self.metrics.done(r, event)
        r.handle.put(event)
        if not self._requests:
            self._idle.set()

    # ---- runner events ----

    def _drain(self) -> None:
        t0 = time.perf_counter()
        events = self.runner.events
        while events:
            event = events.popleft()
            getattr(self, "_on_" + type(event).__name__.lower())(event)
        self._admit()
        self.metrics.control_seconds.inc(time.perf_counter() - t0)

    def _on_loaded(self, ev: m.Loaded) -> None:
        self.info = ev.info
        self.config = self.config.resolve(ev.info)
        self._admission = Admission(self.config, ev.info, self.runner.send)
        self.reuse = Reuse(self, ev.info)
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_result(None)

    def _on_died(self, ev: m.Died) -> None:
        self.dead = True
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_exception(RuntimeError(ev.error))
        for r in list(self._requests.values()):
            self._complete(r, "error", ev.error)

    def _on_started(self, ev: m.Started) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            return
        r.phase, r.committed, r.reused = Phase.RUNNING, ev.reused, ev.reused
        if r.clone_upto:
            self.reuser.donor_started(r, ev)
        if r.named is not None:
            r.reuse_source = "session" if ev.reused else None
        elif ev.clone_index is not None:
            r.reuse_source = "cache"
            self.reuser.observe_clone(ev.reused, ev.clone_s)
            self.adm.cache.touch(r.cache_matches[ev.clone_index].entry)
        elif not ev.reused:
            r.reuse_source = None
        if r.named is None and r.reuse_source != "donor":
            (self.metrics.cache_hits if ev.clone_index is not None else self.metrics.cache_misses).inc()
        if r.cache_matches:
            self.metrics.clone("cache", ev.refused, ev.clone_index is not None)

    def _on_token(self, ev: m.Token) -> None:
        r = self._requests.get(ev.rid)
        if r is None or r.ending:
            return  # asked to end: what the runner made meanwhile is dropped
        now = time.monotonic()
        self.metrics.token(r, now)
        r.first_token_at = r.first_token_at or now
        r.last_token_at = now
        r.handle.put(TokenEvent(ev.sampled.token, ev.sampled.logprob, ev.sampled.top_logprobs))

    def _on_captured(self, ev: m.Captured) -> None:
        adm = self.adm
        r = self._requests.get(ev.rid)
        if r is not None:
            adm.free_capture_slot(r)
        if ev.session is None:
            self.metrics.captures.inc(outcome="refused")
        elif r is None or r.ending == "cancelled":  # a capture of a cancelled request is discarded
            self.metrics.captures.inc(outcome="discarded")
            adm.release_sessions([ev.session])
        else:
            self.metrics.captures.inc(outcome="stored")
            adm.store_capture(ev.tokens, ev.session, ev.nbytes)

    def _on_finished(self, ev: m.Finished) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            self.adm.release_sessions([ev.session])
            return
        if r.named is not None:
            self.adm.named.release(r.named.name, ev.session, ev.held)
        r.prefilled, r.generated = ev.prefilled, ev.generated
        self._complete(r, ev.reason, ev.error)

    def _on_clonedone(self, ev: m.CloneDone) -> None:
        r = self._requests.get(ev.rid)
        if r is None or not (r.phase is Phase.FOLLOWING or r.clone_upto):  # it left, or stopped following
            self.adm.release_sessions([ev.session])
        else:
            self.reuser.clone_done(r, ev)

    def _on_holding(self, ev: m.Holding) -> None:
        self.stats.live_sessions, self.stats.total_bytes = ev.live_sessions, ev.total_bytes

    def _on_stepstats(self, ev: m.StepStats) -> None:
        self.stats = ev
        self.metrics.step(ev)
        self.reuser.step(ev)
        for rid, position in ev.committed.items():
            r = self._requests.get(rid)
            if r is not None:
                r.committed = position
