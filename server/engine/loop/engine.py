"""The engine: the control loop's side of the daemon, over the runner thread that owns the model.

    engine = Engine(backend, model_path, dtype, config, registry)
    await engine.start()                 # the runner thread loads the model
    handle = engine.submit(request)      # sync; raises an EngineError when turned away
    handles = engine.submit_choices(request)  # n > 1: one handle per choice, choice i at index i
    async for event in handle: ...       # TokenEvents, then one DoneEvent
    await engine.shutdown(grace_s)

The split is the design: the runner thread (runner.py) owns the backend and runs one StepPlan per step;
the control loop runs the policy, and never calls the backend nor blocks. Commands go to the runner
through `Runner.send`; its events come back on a lock-free queue, read by `_drain`. This module is the
lifecycle (load, failure, shutdown); the state machine over requests is `Serving` (serving.py), built
once the runner has loaded the model, with its managers: Admission (budget and queue), Index (reusable
states), NamedSessions, DiskTier; none calls back into it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from kvfork.backends.base import Backend, KVStorageRefused, ModelInfo
from kvfork.backends.model_path import resolve_model
from kvfork.server.settings import validate
from kvfork.server.engine import messages as m
from kvfork.server.engine.api import GenerateRequest, MetricRegistry, NotReady
from kvfork.server.engine.cache.disk import DiskTier, fingerprint, tier_secret
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop import request as phase
from kvfork.server.engine.loop.request import Request, RequestHandle
from kvfork.server.engine.loop.serving import Serving
from kvfork.server.engine.loop.stats import EngineStats
from kvfork.server.engine.loop.telemetry import EngineMetrics
from kvfork.server.engine.loop.utilization import EngineLoad
from kvfork.server.engine.policy.memory_plan import MemoryPlan, resolve_config
from kvfork.server.engine.policy.rates import LiveRates, RateTracker
from kvfork.server.engine.worker.drafts import Drafts
from kvfork.server.engine.worker.runner import Runner

log = logging.getLogger("kvfork.engine")

STOP_WAIT_S = 10.0  # after the grace period: how long cancelled requests get to leave before we stop waiting


class Engine:
    def __init__(self, backend: Backend, model_path: str, dtype: str | None, config: EngineConfig,
                 registry: MetricRegistry, kv_dir: Path | None = None, kv_events: Any = None,
                 plans: Callable[[Any], None] | None = None, drafts: Drafts | None = None):
        """`kv_dir`: where the prefix cache's disk tier lives (disk.kv_root()); None: no disk tier.
        `kv_events`: told where reusable states are stored and removed (server/kv_events.KVEvents); None: off.
        `plans`: handed each plan.StepPlan before it runs (a recorder: plan.replay runs them again).
        `drafts`: speculative decoding's drafters (drafts.Drafts, or a test's double), read when the runner
        starts; None: the ones `config.speculative` names, none when it is off."""
        validate(config)
        self.backend, self.model_path, self.dtype, self.config = backend, model_path, dtype, config
        self.kv_dir, self.registry, self.kv_events, self._plans = kv_dir, registry, kv_events, plans
        self.drafts = drafts if drafts is not None or config.speculative == "off" else Drafts.from_config(config)
        self.info: ModelInfo | None = None
        self.memory: MemoryPlan | None = None  # where the KV budget comes from, once loaded
        self.dead = False
        self.failure: str | None = None  # why the engine stopped serving, once it did
        self._closing = False
        self._runner: Runner | None = None
        self._loaded: asyncio.Future | None = None
        self._serving: Serving | None = None  # the state machine, once the model is loaded
        self._rates = LiveRates()  # the cost model's (tools may set a simulated machine's)
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

        c = self.config
        self._runner = Runner(self.backend, self.model_path, self.dtype, c.max_batch_tokens, c.prefill_chunk,
                              c.max_step_ms / 1000, notify, c.clone_mode, self._plans, self.drafts,
                              c.speculative_max_batch, c.kv_storage, c.encoder_cache_bytes, c.inference_slots,
                              c.batch_invariant)
        self._runner.thread.start()
        await self._loaded

    @property
    def loaded(self) -> bool:
        """Whether the model is loaded: from then on `serving` is there."""
        return self._serving is not None

    @property
    def serving(self) -> Serving:
        """The state machine over requests (serving.py) and its managers (`admission`, `index`, `named`, `disk`),
        handed out once the model is loaded; before that it raises NotReady."""
        if self._serving is None:
            raise NotReady("the model is still loading")
        return self._serving

    @property
    def ready(self) -> bool:
        return self.loaded and not self.dead and not self._closing

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish within `grace_s`, cancel the rest, release everything."""
        if self._runner is None or self._closing:
            return
        self._closing = True
        if self.loaded:
            await self._stop_serving(self.serving, grace_s)
        self._runner.send(m.StopRunner())
        await asyncio.to_thread(self._runner.thread.join, STOP_WAIT_S)
        self._drain()  # the cache's last spills go to the disk tier here
        if self.loaded and self.serving.disk is not None:
            await self.serving.disk.close()  # after the last spills have been answered

    async def _stop_serving(self, serving: Serving, grace_s: float) -> None:
        serving.closing = True
        for r in serving.requests():  # not started yet: nothing in flight to finish
            if isinstance(r.phase, phase.Waiting):
                serving.cancel(r.rid)
        await self._wait_idle(serving, grace_s)
        for r in serving.requests():
            serving.cancel(r.rid)
        await self._wait_idle(serving, STOP_WAIT_S)
        for r in serving.requests():  # the runner is stuck or dead: answer them anyway
            serving.complete(r, "cancelled")
        serving.admission.drain()

    @property
    def runner_alive(self) -> bool:
        return self._runner is not None and self._runner.thread.is_alive()

    async def _wait_idle(self, serving: Serving, timeout: float) -> None:
        if serving.requests() and not self.dead:
            try:
                await asyncio.wait_for(serving.idle.wait(), timeout)
            except TimeoutError:
                pass

    # ---- what telemetry, tools and tests read (nothing until the model is loaded; its managers: `serving`) ----

    def requests(self) -> list[Request]:
        """The requests it holds now, in admission order (read, never changed: the reuse page's)."""
        return self.serving.requests() if self.loaded else []

    def request(self, rid: int) -> Request | None:
        return next((r for r in self.requests() if r.rid == rid), None)

    def stats(self) -> EngineStats:
        """What it holds now, as one frozen value (stats.py): what tests, tools and metrics read."""
        return self.serving.stats() if self.loaded else EngineStats()

    @property
    def rates(self) -> RateTracker:
        """The cost model's measured rates (tools and tests may set a simulated machine's)."""
        return self._rates.tracker

    @rates.setter
    def rates(self, tracker: RateTracker) -> None:
        self._rates.tracker = tracker

    def utilization(self) -> EngineLoad:
        """What it carries now (utilization.py); all zeros until the model is loaded."""
        info = self.info
        if not self.loaded or info is None:
            return EngineLoad()
        serving = self.serving
        admission = serving.admission
        per_token = max(1, info.kv.full_bytes_per_token)
        evictable = serving.index.nbytes("memory") + serving.named.idle_bytes() + admission.lent
        pinned = max(0, admission.held() - evictable)
        prompts = self.metrics.prompt_tokens.get()
        reused = sum(self.metrics.reused_tokens.values.values())
        return EngineLoad(running=admission.slots_used, waiting=self.waiting(),
                          waiting_prompt_tokens=admission.queued_tokens, slots=self.config.inference_slots,
                          used_tokens=pinned // per_token, budget_tokens=admission.budget // per_token,
                          reused_fraction=reused / prompts if prompts else 0.0)

    # ---- requests ----

    def submit(self, req: GenerateRequest) -> RequestHandle:
        assert req.n == 1, "n > 1 is submit_choices"
        return self.submit_choices(req)[0]

    def submit_choices(self, req: GenerateRequest) -> list[RequestHandle]:
        """`req.n` choices over one prompt, admitted together; choice 0 prefills it (and is the request
        reuse sees), the others start from clones of it (runner.py)."""
        if not self.ready:
            raise NotReady("the engine is not running" if self.info is not None else "the model is still loading")
        return self.serving.submit_choices(req)

    @property
    def recurrent_checkpoints(self) -> int:
        """How many message boundaries a request keeps its recurrent state at: --recurrent-checkpoints
        on a model with recurrent layers, else none (every other state clones anywhere)."""
        if self.info is None or not self.info.recurrent:
            return 0
        return self.config.recurrent_checkpoints

    def waiting(self) -> int:
        """Requests waiting: queued, and parked behind a leader."""
        return self.serving.waiting() if self.loaded else 0

    def reset_session(self, session_id: str, tenant: str = "") -> bool:
        return self.loaded and self.serving.drop_session(session_id, False, tenant)

    def delete_session(self, session_id: str, tenant: str = "") -> bool:
        return self.loaded and self.serving.drop_session(session_id, True, tenant)

    # ---- the runner's events ----

    def _drain(self) -> None:
        t0 = time.perf_counter()
        assert self._runner is not None
        events = self._runner.events
        while events:
            event = events.popleft()
            if isinstance(event, m.Loaded):
                self._on_loaded(event)
            elif isinstance(event, m.Died):
                self._on_died(event)
            else:
                self.serving.handle(event)  # the runner sends nothing else before Loaded
        if self.loaded:
            self.serving.admit()
        self.metrics.control_seconds.inc(time.perf_counter() - t0)

    def _on_loaded(self, ev: m.Loaded) -> None:
        self.info = ev.info
        self.config, self.memory = resolve_config(self.config, ev.info, ev.device)
        c = self.config
        disk = self._disk_identity(ev.info)
        # Scopes are named under the disk tier's secret, so its files keep their scope across restarts;
        # without the tier, under a key of this process's own.
        index = Index(ev.info, c.prefix_cache_entries, c.prefix_cache_bytes, c.prefix_cache_min_tokens,
                      disk[1] if disk else os.urandom(32))
        tier = None
        if disk is not None:
            assert self.kv_dir is not None
            tier = DiskTier(self.kv_dir, disk[0], c.prefix_cache_disk_bytes, index)
        assert self._runner is not None
        self._serving = Serving(c, ev.info, index, tier, self._runner.send, self.metrics, self._rates)
        if self.kv_events is not None:
            self.kv_events.attach(index, tier is not None and tier.on)
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_result(None)

    def _disk_identity(self, info: ModelInfo) -> tuple[str, bytes] | None:
        """The prefix cache's disk tier's fingerprint and secret (disk.py), when the tier is asked for and the
        backend can save sessions (base.py); None: no disk tier."""
        if not self.kv_dir or not self.config.prefix_cache_disk_bytes or self.config.prefix_cache_entries == 0:
            return None
        if type(self.backend).export_state is Backend.export_state:
            log.warning("prefix cache disk tier off: %s cannot save sessions", type(self.backend).__name__)
            return None
        try:
            # rows computed batch-invariantly are another computation's: a daemon of each mode reads its own files
            computed = " batch-invariant" if self.config.batch_invariant else ""
            fp = fingerprint(resolve_model(self.model_path), info.dtype, self.backend.state_format,
                             info.kv_dtype + computed)
        except OSError as exc:
            log.warning("prefix cache disk tier off: cannot fingerprint the model (%r)", exc)
            return None
        try:
            return fp, tier_secret(self.kv_dir)
        except OSError as exc:
            log.warning("prefix cache disk tier off: cannot keep its secret (%r)", exc)
            return None


    def fail(self, error: str) -> None:
        """The backend failed outside any runner call (a rank stopped answering): as if the runner died."""
        if not self.dead:
            self._on_died(m.Died(error))

    def _on_died(self, ev: m.Died) -> None:
        self.dead, self.failure = True, ev.error
        if self._loaded is not None and not self._loaded.done():
            self._loaded.set_exception(KVStorageRefused(ev.error) if ev.refused else RuntimeError(ev.error))
        for r in self.requests():
            self.serving.complete(r, "error", ev.error)
