"""The engine facade the daemon drives, living on the control loop.

It admits requests, picks where each starts from, hands work to the runner
thread, and turns the runner's events into each request's stream. It never
calls the backend and never blocks: the runner owns the model.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from backends.base import Backend, ModelInfo
from server.engine import messages as m
from server.engine.admission import Admission
from server.engine.api import (CapacityExhausted, ContextTooLong, DoneEvent, GenerateRequest, InvalidRequest,
                               NotReady, TokenEvent)
from server.engine.config import EngineConfig
from server.engine.request import Phase, Request, RequestHandle
from server.engine.runner import Runner
from server.engine.scheduler import clamp_max_tokens
from server.engine.sessions import check_session_id
from server.engine.telemetry import EngineMetrics
from server.metrics import Registry
from server.settings import validate

STOP_WAIT_S = 10.0  # after the grace period: how long cancelled requests get to leave before we stop waiting


class Engine:
    def __init__(self, backend: Backend, model_path: str, dtype: str | None, config: EngineConfig,
                 registry: Registry):
        validate(config)
        self.backend, self.model_path, self.dtype, self.config = backend, model_path, dtype, config
        self.info: ModelInfo | None = None
        self.dead = False
        self._closing = False
        self._runner: Runner | None = None
        self._loaded: asyncio.Future | None = None
        self._admission: Admission | None = None
        self._requests: dict[int, Request] = {}
        self._next_rid = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.stats = m.StepStats({}, 0, 0, 0.0, 0.0)
        self.metrics = EngineMetrics(registry, {
            "queue_depth": ("requests waiting for a slot", lambda: len(self._admission.queue) if self._admission else 0),
            "running_requests": ("requests holding an inference slot",
                                 lambda: self._admission.slots_used if self._admission else 0),
            "live_sessions": ("backend sessions open", lambda: self.stats.live_sessions),
            "kv_bytes": ("bytes of KV state the backend holds", lambda: self.stats.total_bytes),
            "named_sessions": ("named sessions kept", lambda: len(self._admission.named) if self._admission else 0),
            "prefix_cache_entries": ("snapshots in the prefix cache",
                                     lambda: len(self._admission.cache) if self._admission else 0),
            "prefix_cache_bytes": ("bytes of the prefix cache",
                                   lambda: self._admission.cache.nbytes if self._admission else 0),
        })

    # ---- lifecycle ----

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loaded = loop.create_future()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        self._runner = Runner(self.backend, self.model_path, self.dtype, self.config.max_batch_tokens,
                              self.config.prefill_chunk, notify)
        self._runner.thread.start()
        await self._loaded

    @property
    def ready(self) -> bool:
        return self.info is not None and not self.dead and not self._closing

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish within `grace_s`, cancel the rest, release everything."""
        if self._runner is None or self._closing:
            return
        self._closing = True
        for r in list(self._requests.values()):
            if not r.holds_slot or r.phase is Phase.CLONING:
                self._cancel(r.rid)
        await self._wait_idle(grace_s)
        for rid in list(self._requests):
            self._cancel(rid)
        await self._wait_idle(STOP_WAIT_S)
        for r in list(self._requests.values()):  # the runner is stuck or dead: answer them anyway
            self._complete(r, "cancelled")
        if self._admission is not None:
            self._admission.release_sessions(self._admission.drain())
        self._runner.send(m.Stop())
        await asyncio.to_thread(self._runner.thread.join, STOP_WAIT_S)
        self._drain()

    async def _wait_idle(self, timeout: float) -> None:
        if self._requests and not self.dead:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass

    # ---- requests ----

    def submit(self, req: GenerateRequest) -> RequestHandle:
        if not self.ready or self._admission is None or self._runner is None:
            raise NotReady("the engine is not running" if self.info is not None else "the model is still loading")
        adm, config = self._admission, self.config
        n = len(req.prompt)
        if n == 0:
            raise InvalidRequest("the prompt holds no tokens")
        if n >= config.max_context:  # type: ignore[operator]
            raise ContextTooLong(f"the prompt has {n} tokens; the context holds {config.max_context}, "
                                 "prompt and output together")
        if req.session_id is not None:
            try:
                check_session_id(req.session_id)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        max_tokens = clamp_max_tokens(req.max_tokens, config.max_tokens, n, config.max_context)  # type: ignore
        need = adm.bytes_for(n + max_tokens)
        if adm.never_fits(need):
            raise CapacityExhausted(f"the request needs {need} bytes of KV state; the budget is {adm.budget}")
        waits = bool(adm.queue) or adm.slots_used >= config.inference_slots
        if waits and len(adm.queue) >= config.max_queue:
            raise CapacityExhausted(f"{len(adm.queue)} requests are already waiting")
        named = None
        if req.session_id is not None:
            named, evicted = adm.named.acquire(req.session_id)
            adm.release_sessions(evicted)
        stop_ids = req.stop_token_ids | (frozenset() if req.ignore_eos else frozenset(self.info.eos_token_ids))
        self._next_rid += 1
        rid = self._next_rid
        handle = RequestHandle(req.request_id, lambda: self._cancel(rid), lambda: self._finish(rid))
        r = self._requests[rid] = Request(rid, req, handle, max_tokens, stop_ids, need, named)
        self._idle.clear()
        adm.queue.append(r)
        self._admit()
        if r.phase is Phase.QUEUED:
            r.expiry = asyncio.get_running_loop().call_later(config.queue_timeout, self._expire, rid)
        return handle

    def reset_session(self, session_id: str) -> bool:
        return self._drop_session(session_id, forget=False)

    def delete_session(self, session_id: str) -> bool:
        return self._drop_session(session_id, forget=True)

    def _drop_session(self, session_id: str, forget: bool) -> bool:
        if self._admission is None:
            return False
        existed, held = self._admission.named.drop(session_id, forget)
        self._admission.release_sessions([held])
        return existed

    def _cancel(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending == "cancelled":
            return
        r.ending = "cancelled"
        if r.phase in (Phase.STARTING, Phase.RUNNING):
            self._runner.send(m.Cancel(rid))  # type: ignore[union-attr]
        else:  # the runner holds nothing of it (a pending clone comes back to nobody and is released)
            self._complete(r, "cancelled")
            self._admit()

    def _finish(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending:
            return
        r.ending = "stop"
        if r.phase in (Phase.STARTING, Phase.RUNNING):
            self._runner.send(m.Finish(rid))  # type: ignore[union-attr]
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
            self._start(r)

    def _start(self, r: Request, **source: Any) -> None:
        r.phase = Phase.STARTING
        self._runner.send(self._admission.start(r, **source))  # type: ignore[union-attr]

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
        events = self._runner.events  # type: ignore[union-attr]
        while events:
            event = events.popleft()
            getattr(self, "_on_" + type(event).__name__.lower())(event)
        self._admit()

    def _on_loaded(self, ev: m.Loaded) -> None:
        self.info = ev.info
        self.config = self.config.resolve(ev.info)
        self._admission = Admission(self.config, ev.info, self._runner.send)  # type: ignore[union-attr]
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
        if r.named is not None:
            r.reuse_source = "session" if ev.reused else None
        elif ev.clone_index is not None:
            r.reuse_source = "cache"
            self._admission.cache.touch(r.cache_matches[ev.clone_index].entry)  # type: ignore[union-attr]
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
        adm = self._admission
        r = self._requests.get(ev.rid)
        if r is not None:
            adm.free_capture_slot(r)  # type: ignore[union-attr]
        if ev.session is None:
            self.metrics.captures.inc(outcome="refused")
        elif r is None or r.ending == "cancelled":  # a capture of a cancelled request is discarded
            self.metrics.captures.inc(outcome="discarded")
            adm.release_sessions([ev.session])  # type: ignore[union-attr]
        else:
            self.metrics.captures.inc(outcome="stored")
            adm.store_capture(ev.tokens, ev.session, ev.nbytes)  # type: ignore[union-attr]

    def _on_finished(self, ev: m.Finished) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            self._admission.release_sessions([ev.session])  # type: ignore[union-attr]
            return
        if r.named is not None:
            self._admission.named.release(r.named.name, ev.session, ev.held)  # type: ignore[union-attr]
        r.prefilled, r.generated = ev.prefilled, ev.generated
        self._complete(r, ev.reason, ev.error)

    def _on_clonedone(self, ev: m.CloneDone) -> None:
        r = self._requests.get(ev.rid)
        if r is None or r.phase is not Phase.CLONING:
            self._admission.release_sessions([ev.session])  # type: ignore[union-attr]

    def _on_stepstats(self, ev: m.StepStats) -> None:
        self.stats = ev
        self.metrics.step(ev)
        for rid, position in ev.committed.items():
            r = self._requests.get(rid)
            if r is not None:
                r.committed = position
