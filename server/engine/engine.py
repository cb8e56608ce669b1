"""The engine facade the daemon drives, living on the control loop.

    engine = Engine(backend, model_path, dtype, config, registry)
    await engine.start()                 # the runner thread loads the model
    handle = engine.submit(request)      # sync; raises an EngineError when turned away
    async for event in handle: ...       # TokenEvents, then one DoneEvent
    await engine.shutdown(grace_s)

It admits requests, picks where each starts from, hands work to the runner
thread, and turns the runner's events into each request's stream (control.py).
It never calls the backend and never blocks: the runner owns the model.
"""

from __future__ import annotations

import asyncio

from backends.base import Backend, ModelInfo
from server.engine import messages as m
from server.engine.admission import Admission
from server.engine.api import GenerateRequest, NotReady
from server.engine.config import EngineConfig
from server.engine.control import Control
from server.engine.request import Phase, Request, RequestHandle
from server.engine.reuse import Reuse
from server.engine.runner import Runner
from server.engine.telemetry import EngineMetrics
from server.metrics import Registry
from server.settings import validate

STOP_WAIT_S = 10.0  # after the grace period: how long cancelled requests get to leave before we stop waiting


class Engine(Control):
    def __init__(self, backend: Backend, model_path: str, dtype: str | None, config: EngineConfig,
                 registry: Registry):
        validate(config)
        self.backend, self.model_path, self.dtype, self.config = backend, model_path, dtype, config
        self.registry = registry
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
        self.reuse: Reuse | None = None
        self.metrics = EngineMetrics(registry, self)

    # ---- lifecycle ----

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._loaded = loop.create_future()

        def notify() -> None:
            try:
                loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        self._runner = Runner(self.backend, self.model_path, self.dtype, self.config.max_batch_tokens,
                              self.config.prefill_chunk, self.config.max_step_ms / 1000, notify)
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
            if r.phase in (Phase.QUEUED, Phase.FOLLOWING):
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
        max_tokens, need = adm.check(req, waiting=len(adm.queue) + len(self.reuser.followers))
        named = None
        if req.session_id is not None:
            named, evicted = adm.named.acquire(req.session_id)
            adm.release_sessions(evicted)
        eos = frozenset() if req.ignore_eos else frozenset(self.info.eos_token_ids)  # type: ignore[union-attr]
        stop_ids = req.stop_token_ids | eos
        self._next_rid += 1
        rid = self._next_rid
        handle = RequestHandle(req.request_id, lambda: self._cancel(rid), lambda: self._finish(rid))
        r = self._requests[rid] = Request(rid, req, handle, max_tokens, stop_ids, need, named)
        self._idle.clear()
        adm.queue.append(r)
        self._admit()
        if r.phase is Phase.QUEUED:
            r.expiry = asyncio.get_running_loop().call_later(config.queue_timeout, self._expire, rid)
            self.reuser.arrived(r)
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
