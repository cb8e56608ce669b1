"""The engine core, one object on the control loop.

    engine = Engine(backend, model_path, dtype, config, registry)
    await engine.start()                 # the runner thread loads the model
    handle = engine.submit(request)      # sync; raises an EngineError when turned away
    handles = engine.submit_choices(request)  # n > 1: one handle per choice, choice i at index i
    async for event in handle: ...       # TokenEvents, then one DoneEvent
    await engine.shutdown(grace_s)

It admits requests (admission.py), picks where each starts from (reuse.py),
hands work to the runner thread, and turns the runner's events into each
request's stream, moving the request through its phases (request.py) until its
one DoneEvent is delivered. It never calls the backend and never blocks: the
runner owns the model.

Design rule: this object's state is its own. Its collaborators (Reuse,
EngineMetrics) get the narrow public interface below ("for collaborators");
no other module touches a private member (tests/test_engine_boundary.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from backends.base import Backend, ModelInfo
from backends.model_path import resolve_model
from server.engine import messages as m
from server.engine.admission import Admission
from server.engine.api import CapacityExhausted, DoneEvent, GenerateRequest, NotReady, TokenEvent, choice_sampling
from server.engine.config import EngineConfig
from server.engine.disk import DiskTier, fingerprint
from server.engine.request import Phase, Request, RequestHandle
from server.engine.reuse import Reuse
from server.engine.runner import Runner
from server.engine.telemetry import EngineMetrics
from server.metrics import Registry
from server.settings import validate

log = logging.getLogger("kvfork.engine")

STOP_WAIT_S = 10.0  # after the grace period: how long cancelled requests get to leave before we stop waiting


class Engine:
    def __init__(self, backend: Backend, model_path: str, dtype: str | None, config: EngineConfig,
                 registry: Registry, kv_dir: Path | None = None, kv_events: Any = None):
        """`kv_dir`: where the prefix cache's disk tier lives (disk.kv_root()); None: no disk tier.
        `kv_events`: told where reusable states are stored and removed (server/kv_events.KVEvents); None: off."""
        validate(config)
        self.backend, self.model_path, self.dtype, self.config = backend, model_path, dtype, config
        self.kv_dir = kv_dir
        self.kv_events = kv_events
        self.registry = registry
        self.info: ModelInfo | None = None
        self.dead = False
        self._closing = False
        self._runner: Runner | None = None
        self._loaded: asyncio.Future | None = None
        self._admission: Admission | None = None
        self._reuse: Reuse | None = None
        self._requests: dict[int, Request] = {}
        self._next_rid = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.stats = m.StepStats({}, 0, 0, 0.0, 0.0)
        self.metrics = EngineMetrics(registry, self)

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
                              self.config.prefill_chunk, self.config.max_step_ms / 1000, notify,
                              self.config.clone_mode)
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
        for r in list(self._requests.values()):  # not started yet: nothing in flight to finish
            if r.phase in (Phase.QUEUED, Phase.FOLLOWING, Phase.RESTORING):
                self._cancel(r.rid)
        await self._wait_idle(grace_s)
        for rid in list(self._requests):
            self._cancel(rid)
        await self._wait_idle(STOP_WAIT_S)
        for r in list(self._requests.values()):  # the runner is stuck or dead: answer them anyway
            self.complete(r, "cancelled")
        if self._admission is not None:
            self._admission.release_sessions(self._admission.drain())
        self._runner.send(m.Stop())
        await asyncio.to_thread(self._runner.thread.join, STOP_WAIT_S)
        self._drain()  # the cache's last spills go to the disk tier here
        if self._admission is not None and self._admission.disk is not None:
            await asyncio.to_thread(self._admission.disk.close)

    @property
    def runner_alive(self) -> bool:
        return self._runner is not None and self._runner.thread.is_alive()

    async def _wait_idle(self, timeout: float) -> None:
        if self._requests and not self.dead:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass

    # ---- requests ----

    def submit(self, req: GenerateRequest) -> RequestHandle:
        assert req.n == 1, "n > 1 is submit_choices"
        return self.submit_choices(req)[0]

    def submit_choices(self, req: GenerateRequest) -> list[RequestHandle]:
        """`req.n` choices over one prompt, admitted together; choice 0 prefills it (and is the request
        reuse sees), the others start from clones of it (runner.py)."""
        if not self.ready or self._admission is None or self._runner is None:
            raise NotReady("the engine is not running" if self.info is not None else "the model is still loading")
        adm, config = self._admission, self.config
        max_tokens, need, choice_need = adm.check(req, waiting=self.waiting())
        named = None
        if req.session_id is not None:  # a busy session gives None: the request runs without it
            named, evicted = adm.named.acquire(req.session_id, req.scope.tenant)
            adm.release_sessions(*evicted)
        eos = frozenset() if req.ignore_eos else frozenset(self.info.eos_token_ids)  # type: ignore[union-attr]
        stop_ids = req.stop_token_ids | eos
        self._next_rid += 1
        rid = self._next_rid
        handle = RequestHandle(req.request_id, lambda: self._cancel(rid), lambda: self._finish(rid))
        r = self._requests[rid] = Request(rid, req, handle, max_tokens, stop_ids, need, named)
        r.no_follow = req.n > 1  # its choices hold their slots from admission: it clones now or prefills
        for i in range(1, req.n):
            self._next_rid += 1
            choice = self._next_rid
            sibling = Request(choice, replace(req, sampling=choice_sampling(req.sampling, i), n=1),
                              RequestHandle(req.request_id, lambda c=choice: self._cancel(c),
                                            lambda c=choice: self._finish(c)),
                              max_tokens, stop_ids, choice_need, lead=r)
            r.siblings.append(sibling)
            self._requests[choice] = sibling
        if named is not None:
            adm.hold_named(r)
        self._idle.clear()
        adm.queue.append(r)
        self.admit()
        if r.phase is Phase.QUEUED:
            self.expire_at(r, r.submitted_at + config.queue_timeout)
            self.reuser.arrived(r)
        if r.phase is Phase.FOLLOWING and not adm.can_wait(self.waiting() - 1):
            # A follower waits like a queued request: it counts against --max-queue when it parks.
            self._withdraw(r)
            raise CapacityExhausted(f"{self.waiting()} requests are already waiting")
        return [handle] + [s.handle for s in r.siblings]

    @property
    def recurrent_checkpoints(self) -> int:
        """How many message boundaries a request keeps its recurrent state at: --recurrent-checkpoints
        on a model with recurrent layers, else none (every other state clones anywhere)."""
        if self.info is None or not any(layer.kind == "recurrent" for layer in self.info.layers):
            return 0
        return self.config.recurrent_checkpoints

    def waiting(self) -> int:
        """Requests waiting: queued, and parked behind a leader."""
        return len(self.adm.queue) + len(self.reuser.followers)

    def reset_session(self, session_id: str, tenant: str = "") -> bool:
        return self._drop_session(session_id, forget=False, tenant=tenant)

    def delete_session(self, session_id: str, tenant: str = "") -> bool:
        return self._drop_session(session_id, forget=True, tenant=tenant)

    def _drop_session(self, session_id: str, forget: bool, tenant: str) -> bool:
        if self._admission is None:
            return False
        existed, held = self._admission.named.drop(session_id, forget, tenant)
        self._admission.release_sessions(*held)
        return existed

    # ---- for collaborators (reuse.py, telemetry.py); set once the model is loaded ----

    @property
    def admission(self) -> Admission | None:
        return self._admission

    @property
    def adm(self) -> Admission:
        assert self._admission is not None
        return self._admission

    @property
    def reuse(self) -> Reuse | None:
        return self._reuse

    @property
    def reuser(self) -> Reuse:
        assert self._reuse is not None
        return self._reuse

    def send(self, command: Any) -> None:
        """A command to the runner thread."""
        assert self._runner is not None
        self._runner.send(command)

    def request(self, rid: int) -> Request | None:
        return self._requests.get(rid)

    def requests(self) -> Iterable[Request]:
        return self._requests.values()

    def admit(self) -> None:
        """Give free slots to the queue's head while its bytes fit; each admitted request is placed."""
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
            for sibling in r.waiting_siblings:  # they hold their slots now, and go to the runner with r's Start
                sibling.phase, sibling.admitted_at = Phase.STARTING, r.admitted_at
            self.reuser.place(r)

    def start_request(self, r: Request, **source: Any) -> None:
        """Hand a request holding a slot to the runner (`source`: see Admission.start)."""
        r.phase = Phase.STARTING
        self.send(self.adm.start(r, **source))
        for sibling in r.waiting_siblings:
            sibling.sent = True
        self.reuser.started(r)

    def expire_at(self, r: Request, deadline: float) -> None:
        """(Re)arm the queue timeout of a waiting request, at `deadline` on the monotonic clock."""
        if r.expiry is not None:
            r.expiry.cancel()
        loop = asyncio.get_running_loop()
        r.expiry = loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, r.rid)

    # ---- request ends ----

    def _cancel(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending == "cancelled":
            return
        r.ending = "cancelled"
        if self._with_runner(r):
            self.send(m.Cancel(rid))
        else:  # the runner holds nothing of it (a pending clone comes back to nobody and is released)
            self.complete(r, "cancelled")
            self.admit()

    def _finish(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending:
            return
        r.ending = "stop"
        if self._with_runner(r):
            self.send(m.Finish(rid))
        else:
            self.complete(r, "stop")

    @staticmethod
    def _with_runner(r: Request) -> bool:
        """Whether the runner has (or will have) `r`: a choice goes there only with its lead's Start."""
        return r.phase in (Phase.STARTING, Phase.RUNNING) and (r.lead is None or r.sent)

    def _expire(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is not None and r.phase in (Phase.QUEUED, Phase.FOLLOWING, Phase.RESTORING):
            self.complete(r, "error", f"waited longer than --queue-timeout ({self.config.queue_timeout:g} s)")
            self.admit()  # the expired head may have been all that held the queue back

    def _release_hold(self, r: Request) -> None:
        """Everything `r` holds on the loop: its slot, bytes, capture slot, named session, landed clone."""
        if self._reuse is not None:  # first: a clone order it abandons keeps its bytes held
            self._reuse.gone(r)
        adm = self._admission
        if adm is not None:
            if r.holds_slot:
                adm.free_slot(r)
            adm.let_go(r)
            adm.free_capture_slot(r)
            if r.phase is Phase.QUEUED and r in adm.queue:
                adm.queue.remove(r)
            if r.named is not None and r.named.busy:
                adm.named.release(r.named, r.named.session, r.named.tokens, r.named.scope, r.named.nbytes,
                                  r.named.frees)
            if r.landed is not None:
                adm.release_sessions([r.landed[0]])
        if r.expiry is not None:
            r.expiry.cancel()
        r.phase = Phase.DONE
        del self._requests[r.rid]
        if not self._requests:
            self._idle.set()

    def _withdraw(self, r: Request) -> None:
        """Turned away after all: as if it never came (no DoneEvent, nobody holds its handle yet)."""
        self._release_hold(r)
        for sibling in r.siblings:
            self._release_hold(sibling)

    def complete(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.phase is Phase.DONE:
            return
        self._release_hold(r)
        event = DoneEvent(reason, r.usage(time.monotonic()), error)  # type: ignore[arg-type]
        self.metrics.done(r, event)
        r.handle.put(event)
        for sibling in r.waiting_siblings:  # it ended before the runner had it: so do its other choices
            self.complete(sibling, reason, error)

    # ---- runner events ----

    def _drain(self) -> None:
        t0 = time.perf_counter()
        assert self._runner is not None
        events = self._runner.events
        while events:
            match events.popleft():
                case m.Loaded() as ev:
                    self._on_loaded(ev)
                case m.Died() as ev:
                    self._on_died(ev)
                case m.Started() as ev:
                    self._on_started(ev)
                case m.Token() as ev:
                    self._on_token(ev)
                case m.Captured() as ev:
                    self._on_captured(ev)
                case m.Finished() as ev:
                    self._on_finished(ev)
                case m.CloneDone() as ev:
                    self._on_clone_done(ev)
                case m.Exported() as ev:
                    self._on_exported(ev)
                case m.Restored() as ev:
                    self._on_restored(ev)
                case m.Holding() as ev:
                    self._on_holding(ev)
                case m.StepStats() as ev:
                    self._on_step_stats(ev)
                case other:
                    raise TypeError(f"unknown runner event {other!r}")
        self.admit()
        self.metrics.control_seconds.inc(time.perf_counter() - t0)

    def _on_loaded(self, ev: m.Loaded) -> None:
        self.info = ev.info
        self.config = self.config.resolve(ev.info)
        self._admission = Admission(self.config, ev.info, self.send)
        self._admission.disk = self._open_disk(ev.info)
        if self.kv_events is not None:
            self.kv_events.attach(self._admission.cache, self._admission.disk)
        self._reuse = Reuse(self, ev.info)
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_result(None)

    def _open_disk(self, info: ModelInfo) -> DiskTier | None:
        """The prefix cache's disk tier, when asked for and the backend can save sessions (base.py)."""
        if not self.kv_dir or not self.config.prefix_cache_disk_bytes or self.config.prefix_cache_entries == 0:
            return None
        if type(self.backend).export_state is Backend.export_state:
            log.warning("prefix cache disk tier off: %s cannot save sessions", type(self.backend).__name__)
            return None
        try:
            fp = fingerprint(resolve_model(self.model_path), info.dtype, type(self.backend).__name__)
        except OSError as exc:
            log.warning("prefix cache disk tier off: cannot fingerprint the model (%r)", exc)
            return None
        windows = [layer.window for layer in info.layers if layer.kind == "sliding" and layer.window]
        recurrent = any(layer.kind == "recurrent" for layer in info.layers)
        return DiskTier.open(self.kv_dir, fp, self.config.prefix_cache_disk_bytes, windows, recurrent)

    def _on_died(self, ev: m.Died) -> None:
        self.dead = True
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_exception(RuntimeError(ev.error))
        for r in list(self._requests.values()):
            self.complete(r, "error", ev.error)

    def _on_started(self, ev: m.Started) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            return
        r.phase, r.committed, r.reused = Phase.RUNNING, ev.reused, ev.reused
        if r.clone_upto:
            self.reuser.donor_started(r, ev)
        # Where its session starts is known now: its reservation shrinks to what that session grows to
        # (a named session is always opened empty; a clone at `reused`).
        start = 0 if r.named is not None else ev.reused
        self.adm.hold(r, self.adm.request_bytes(len(r.prompt), r.max_tokens, start,
                                                len(self.adm.checkpoints(r.req))))
        if r.lead is not None:  # a choice's clone of its lead: the prompt is counted once, on choice 0
            r.reused = 0
            return
        r.handle.reused = r.reused  # final from here: APIs that say the usage split up front read it
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
            self.metrics.captures.inc(outcome="failed" if ev.failed else "refused")
        elif r is None or r.ending == "cancelled":  # a capture of a cancelled request is discarded
            self.metrics.captures.inc(outcome="discarded")
            adm.release_sessions([ev.session])
        else:
            self.metrics.captures.inc(outcome="stored")
            adm.store_capture(r, ev.tokens, ev.session, ev.nbytes, r.req.scope, ev.kept)

    def _on_finished(self, ev: m.Finished) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            self.adm.pooled_now(ev.pooled)
            self.adm.release_sessions([ev.session], max(0, ev.nbytes - ev.frees))
            return
        self.adm.pooled_now(ev.pooled)  # with its reservation let go below: its blocks others read are pooled
        if r.named is not None:
            self.adm.named.release(r.named, ev.session, ev.held, r.req.scope, ev.nbytes, ev.frees)
        r.prefilled, r.generated = ev.prefilled, ev.generated
        self.complete(r, ev.reason, ev.error)

    def _on_clone_done(self, ev: m.CloneDone) -> None:
        r = self._requests.get(ev.rid)
        # the answer to an order its request stopped waiting for (it left, or its follow timed out)
        if self.adm.clone_answered(ev.rid) or r is None or not (r.phase is Phase.FOLLOWING or r.clone_upto):
            self.adm.release_sessions([ev.session])
        else:
            self.reuser.clone_done(r, ev)

    def _on_exported(self, ev: m.Exported) -> None:
        """A spilled entry's state is on the host: to its file; its bytes go back once written."""
        adm = self.adm
        tokens, scope, nbytes = ev.key

        def written(_: bool) -> None:
            adm.spilled(nbytes)
            self.admit()

        if ev.state is None or adm.disk is None:
            written(False)
        else:
            adm.disk.write(ev.state, tokens, scope, written)

    def _on_restored(self, ev: m.Restored) -> None:
        r = self._requests.get(ev.rid)
        # the answer to a load its request stopped waiting for
        if self.adm.clone_answered(ev.rid) or r is None or r.phase is not Phase.RESTORING:
            self.adm.release_sessions([ev.session])
        else:
            self.reuser.restored(r, ev)

    def _on_holding(self, ev: m.Holding) -> None:
        self.stats.live_sessions, self.stats.total_bytes, self.stats.blocks = ev.live_sessions, ev.total_bytes, ev.blocks
        self.adm.pooled_now(ev.pooled)
        self.metrics.holding(ev.total_bytes, self.config.kv_budget_bytes)

    def _on_step_stats(self, ev: m.StepStats) -> None:
        self.stats = ev
        self.adm.pooled_now(ev.pooled)
        self.metrics.step(ev)
        self.metrics.holding(ev.total_bytes, self.config.kv_budget_bytes)
        self.reuser.step(ev)
        for rid, position in ev.committed.items():
            r = self._requests.get(rid)
            if r is not None:
                r.committed, r.kept = position, ev.kept.get(rid, ())
