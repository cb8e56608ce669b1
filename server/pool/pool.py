"""The models a daemon serves, loaded on demand under one memory budget: `ModelPool`, the daemon's `Models`
(server/common/state.py) when it serves several.

Each loaded model is a `ServedModel`: its own engine, runner thread and backend, so everything an engine
does (admission, the prefix cache, tenants, limits, metrics) stays per model. A request names its model;
`acquire` hands it that model's state, loading the model first when it is not loaded, and holds the model
(a lease, released when the request ends) so it is not unloaded under the request.

Switching: one load or unload runs at a time (`_switching`), so two requests wanting the last memory for
different models never wait on each other: the second's switch starts when the first's has ended. The next
switch is to the model of the longest waiting request, and a request for a loaded model never waits behind
a switch, so A B A C runs as A A B C. Making room unloads the least recently used unpinned model, idle ones
first (the rule, as pure decisions: switching.py); a model still running requests stops taking new ones and
gives them `--model-switch-timeout` seconds to finish, after which the engine cancels the rest. Between tenants (turns.py): a switch waits for the
other tenants' requests on the model it unloads to end (never cancelled for it), and a tenant's switches
that unload a model another tenant used are --model-switch-interval seconds apart; its request waits
meanwhile, and the other tenants' switches go first. Unloading shuts the engine down, which spills its prefix
cache to the disk tier: loading the model again finds those files and restores from them.

Unloading keeps the model's built weights and its tokenizer (kept.py) in the budget's room or, lent, in a loaded
model's KV budget: its next load starts from them while its folder is unchanged. Kept weights count in the
budget and are the first thing dropped when a load or a request needs the bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from kvfork.backends.model_info import read_model_facts
from kvfork.backends.vision import folder_family
from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import ModelBounds, ModelState, tenant_of
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.generate.chat_output import ModelFormats
from kvfork.server.guard.errors import ApiError
from kvfork.server.pool.budget import PoolBudget
from kvfork.server.pool.keepalive import KeepAlive
from kvfork.server.pool.kept import Kept, KeptModels
from kvfork.server.pool.loadable import check_folder, folder_state
from kvfork.server.pool.served import ModelLoader, ServedModel
from kvfork.server.pool.specs import ModelSpec
from kvfork.server.pool.switching import expired, next_switch, victims
from kvfork.server.pool.turns import SwitchTurns, disrupts, waits_for
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.watch.metrics import Registry

log = logging.getLogger("kvfork")
LEASE = web.RequestKey("model_lease", object)
# A failed load answers again without a new try while its folder is unchanged, for this long: a failure of
# the moment (memory another process held) is tried again after it.
FAILED_LOAD_HOLD_S = 60.0


class StillBroken(Exception):
    """A model's folder is as it was when its last load failed: that failure stands, nothing is evicted."""


@dataclass(eq=False)
class PooledModel:
    """One model the daemon serves, loaded or not."""

    spec: ModelSpec
    pinned: bool
    footprint: int  # its weights and KV budget, bytes of the pool's budget it takes once loaded
    served: ServedModel | None = None
    tenants: collections.Counter[str] = field(default_factory=collections.Counter)  # requests holding it, per tenant
    last_tenant: str | None = None  # whose request took it last
    used: float = 0.0  # when a request last took it (monotonic)
    leaving: bool = False  # unloading: it takes no new request
    attempts: int = 0  # loads tried, so a request knows whether a failure is news to it
    error: str | None = None  # why the last load failed
    failed_on: tuple | None = None  # its folder's files when the last load failed (loadable.py)
    failed_at: float = 0.0  # when (monotonic)
    budget_refused: bool = False  # the last load failed for the budget (its numbers), not the model's files
    known: ModelBounds | None = None  # the context and vocabulary its requests get, from its folder, before it loads
    reads_images: bool = False  # its folder's config names a vision family (backends/vision), known so too
    counter: asyncio.Task[tuple[PromptTokenizer, ModelFormats]] | None = None  # its tokenizer alone, for count_tokens
    files: tuple | None = None  # its folder's files when it loaded (loadable.folder_state)

    @property
    def ready(self) -> bool:
        return self.served is not None and not self.leaving

    @property
    def users(self) -> int:
        """Requests holding it."""
        return sum(self.tenants.values())

    @property
    def refusal(self) -> str:
        """What a request for it hears when its last load failed: the model, not why (`error` holds the paths
        and parsers' words, for the log and for the holder of --metrics-key on /health); a refusal of the
        budget's, which holds numbers alone, as it is."""
        if self.budget_refused and self.error is not None:
            return self.error
        return f"model {self.spec.name!r} could not be loaded; the daemon's log says why"


@dataclass(eq=False)
class Claim:
    """A request's claim on a model (waiting for it, then holding it): which, and whose."""

    model: PooledModel
    tenant: str


def _folder_bounds(path: str, max_context: int | None) -> ModelBounds | None:
    """The context (within --max-context) and vocabulary a model folder's config states, as its backend reads
    them; None without a readable config (its load says what is wrong)."""
    if not (Path(path).expanduser() / "config.json").is_file():
        return None
    try:
        facts = read_model_facts(Path(path).expanduser())
    except (OSError, ValueError):
        return None
    return ModelBounds(min(max_context or facts.context_length, facts.context_length), facts.vocab_size)


class ModelPool:
    def __init__(self, config: ServerConfig, registry: Registry, specs: list[ModelSpec], engine_config: EngineConfig,
                 loader: ModelLoader, budget: PoolBudget):
        self.config, self.registry, self.engine_config = config, registry, engine_config
        self.loader, self.budget = loader, budget
        self.models = {s.name: PooledModel(s, s.name in config.pin, budget.footprint(s)) for s in specs}
        for model in self.models.values():  # read once, here: a request's checks then never wait for a file
            if model.spec.fetch is None:
                self._read_folder(model)
        self.kept = KeptModels(budget)  # what unloaded models left for their next load
        self.default = specs[0].name
        self.switch_timeout, self.ttl = config.model_switch_timeout, config.model_ttl
        self._queue: list[Claim] = []  # waiting requests, in arrival order
        self._turns = SwitchTurns(config.model_switch_interval)
        self._switching: asyncio.Task | None = None
        self._switching_to: PooledModel | None = None  # the model the switch loads (None: an idle unload)
        self._changed = asyncio.Event()
        self._expiry: asyncio.Task | None = None
        self._closed = False
        self._closing: set[asyncio.Task] = set()  # models shutting down, awaited by `shutdown` even when cut short
        self.loads = registry.counter("model_loads_total", "models loaded (several served), by model_name and outcome")
        self.unloads = registry.counter("model_unloads_total", "models unloaded (several served), by model_name and "
                                        "why: room, ttl")

    # ---- what routes call ----

    def model(self, requested: str | None) -> PooledModel:
        """The model a request names; the first model when it names none (or, under --accept-any-model, one
        the daemon does not serve); else 404 model_not_found listing what there is."""
        if requested is None:
            return self.models[self.default]
        model = self.models.get(requested)
        if model is not None:
            return model
        if self.config.accept_any_model:
            return self.models[self.default]
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in self.models)}", code="model_not_found", param="model")

    async def acquire(self, request: web.Request, requested: str | None, stream: bool) -> ModelState:
        """The named model's state, loaded first if need be; held for the request (`release`). A streaming
        request hears keep-alives while it waits (keepalive.py)."""
        if self._closed:
            raise ApiError(503, "the server is shutting down", code="not_ready")
        model = self.model(requested)
        beat = KeepAlive(request, self.config.sse_keepalive) if stream and not model.ready else None
        tenant = tenant_of(request)
        try:
            state = await self.take(model, tenant)
        finally:
            if beat is not None:
                await beat.stop()
        request[LEASE] = Claim(model, tenant)
        return state

    async def take(self, model: PooledModel, tenant: str = "") -> ModelState:
        """Wait until `model` is loaded (starting its load when its turn comes), then hold it for `tenant`."""
        seen, me = model.attempts, Claim(model, tenant)
        self._queue.append(me)
        try:
            while not model.ready:
                if model.attempts > seen and model.error is not None:
                    raise ApiError(503, model.refusal, code="model_load_failed", param="model")
                if self._closed:
                    raise ApiError(503, "the server is shutting down", code="not_ready")
                if self._switching is None and self._next() is me:
                    if self._disrupts(me):
                        self._turns.charge(tenant, time.monotonic())
                    self._switching, self._switching_to = asyncio.create_task(self._switch_to(model, tenant)), model
                held = self._held_back(me)  # its tenant's turn to switch comes later: look again then
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), held or None)
        finally:
            self._queue.remove(me)
        model.tenants[tenant] += 1
        model.last_tenant, model.used = tenant, time.monotonic()
        assert model.served is not None
        return model.served.state

    def known(self, requested: str | None) -> ModelBounds | None:
        """The context and vocabulary a request naming `requested` gets, known without loading the model (its
        folder's config and --max-context, as its engine resolves them, read when the pool was made), so that a
        body over them is refused before anything loads; None where the model's files are not here yet (or say
        no context). Never waits: requests reach `acquire` in the order they came."""
        model = self.model(requested)
        if model.ready:
            assert model.served is not None
            return model.served.state.bounds()
        return model.known

    def reads_images(self, requested: str | None) -> bool:
        """Whether the model a request names reads images, from its folder's config (none until downloaded)."""
        return self.model(requested).reads_images

    def _read_folder(self, model: PooledModel) -> None:
        """What its folder's config says (`known`, `reads_images`), read once its files are here."""
        model.known = _folder_bounds(model.spec.path, self.engine_config.max_context)
        model.reads_images = folder_family(Path(model.spec.path).expanduser()) is not None

    async def counting(self, request: web.Request, requested: str | None
                       ) -> tuple[PromptTokenizer, ModelFormats, int]:
        """The tokenizer, its formats and the context `requested` counts prompts with: the loaded model's (held
        for the request, as `acquire` holds it), else its tokenizer loaded alone (kept), so a count never loads
        a model nor unloads another tenant's."""
        model = self.model(requested)
        if model.ready:
            state = await self.acquire(request, requested, False)
            return state.require_ready(), state.require_formats(), state.context
        known = self.known(requested)
        if known is None:
            raise ApiError(503, f"model {model.spec.name!r} is not on this machine yet: a request for it downloads "
                           "and loads it", code="not_ready", param="model")
        if model.counter is None:
            model.counter = asyncio.create_task(asyncio.to_thread(self.loader.tokenizer, model.spec.path))
        counter = model.counter
        try:
            return *await asyncio.shield(counter), known.context
        except Exception as e:
            if counter.done():
                if model.counter is counter:
                    model.counter = None  # tried again on the next count
                log.warning("model %s: its tokenizer could not be loaded for count_tokens: %s", model.spec.name, e)
                raise ApiError(503, model.refusal, code="model_load_failed", param="model") from None
            raise

    def release(self, model: PooledModel, tenant: str = "") -> None:
        model.tenants[tenant] -= 1
        model.used = time.monotonic()
        self._notify()

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Releases the model a request held, once its handler is done (a failure, inside the stream that opened
        early too, is the error middleware's: server/launch/app.py)."""
        try:
            return await handler(request)
        finally:
            lease = request.get(LEASE)
            if isinstance(lease, Claim):
                self.release(lease.model, lease.tenant)

    @property
    def loading(self) -> str | None:
        """The model a switch is loading now, if any."""
        return self._switching_to.spec.name if self._switching_to is not None else None

    def loaded(self) -> list[ServedModel]:
        return [s.served for s in self.models.values() if s.served is not None]

    def engines(self) -> list[Engine]:
        return [served.engine for served in self.loaded()]

    def recent(self) -> ModelState | None:
        """The state of the model a request used last (what /v1/loads and /debug/reuse show), if any is loaded."""
        ready = [s for s in self.models.values() if s.ready]
        return max(ready, key=lambda s: s.used).served.state if ready else None  # type: ignore[union-attr]

    # ---- switching ----

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _next(self) -> Claim | None:
        """The request the next switch is for (switching.next_switch)."""
        chosen = next_switch([(c.model, self._held_back(c) > 0) for c in self._queue])
        return None if chosen is None else self._queue[chosen]

    def _wanted(self) -> set[PooledModel]:
        """The models requests wait for."""
        return {c.model for c in self._queue}

    def _loaded(self) -> list[PooledModel]:
        return [m for m in self.models.values() if m.served is not None]

    def _held_back(self, claim: Claim) -> float:
        """Seconds before `claim`'s tenant may make the switch it needs (turns.py); 0: now (or none needed)."""
        if claim.model.ready:
            return 0.0
        return self._turns.wait(claim.tenant, self._disrupts(claim), time.monotonic())

    def _disrupts(self, claim: Claim) -> bool:
        """Whether loading `claim`'s model would unload one another tenant used (as room is made now)."""
        going = victims(claim.model, self._loaded(), self._wanted(), self.budget.fits)
        return disrupts(claim.tenant, [(s.tenants, s.last_tenant) for s in going])

    async def _switch_to(self, model: PooledModel, tenant: str | None = None) -> None:
        files, stage = None, "files"
        try:
            files = await asyncio.to_thread(self._loadable, model)
            stage = "room"
            await self._make_room(model, tenant)
            stage = "load"
            await self._load(model, files)
            model.error = model.failed_on = None
            self.loads.inc(model_name=model.spec.name, outcome="loaded")
        except Exception as e:  # the other models keep serving
            if not isinstance(e, StillBroken):
                model.error = f"model {model.spec.name!r} could not be loaded: {e}"
                model.budget_refused = stage == "room"  # the budget's numbers, no path: said to every caller
                model.failed_on = files if stage == "load" else None  # a load's failure, not the budget's: remembered
                model.failed_at = time.monotonic()
            self.loads.inc(model_name=model.spec.name, outcome="failed")
            log.warning("%s", model.error)
        finally:
            model.attempts += 1
            self._switching = self._switching_to = None
            self._settle()

    @staticmethod
    def _loadable(model: PooledModel) -> tuple | None:
        """Refuse, before anything unloads for it, a model whose folder is unchanged since its last load
        failed less than FAILED_LOAD_HOLD_S ago (StillBroken) or whose config or weights' headers cannot be
        read; its folder's files (loadable.folder_state), None where it is not a local folder."""
        if model.spec.fetch is not None:
            return None
        files = folder_state(model.spec.path)
        recent = time.monotonic() - model.failed_at < FAILED_LOAD_HOLD_S
        if files is not None and files == model.failed_on and recent:
            raise StillBroken(model.error)
        check_folder(model.spec.path)
        return files

    async def _load(self, model: PooledModel, files: tuple | None) -> None:
        t0 = time.monotonic()
        kept = self.kept.take(model.spec.name, files)
        served = ServedModel(model.spec, self.config, self.budget.engine_config(self.engine_config, model.spec),
                             self.loader.backend(), kept)
        try:
            await served.load(self.loader)
            refusal = served.engine.memory.refusal if served.engine.memory is not None else None
            if refusal is not None:
                raise ValueError(refusal)
        except BaseException:
            await self._close(served, 0)  # a load cut short (shutdown too) leaves nothing behind
            raise
        model.spec, model.files = served.spec, files
        self._read_folder(model)  # a model fetched for this load: its folder is here now
        model.served, model.used = served, time.monotonic()
        log.info("loaded model %s in %.1f s (%s%s)", model.spec.name, time.monotonic() - t0,
                 self.budget.describe(model.footprint), ", from what its last unload kept" if kept else "")

    async def _make_room(self, model: PooledModel, tenant: str | None) -> None:
        """Unload least recently used unpinned models until `model` fits the budget and --max-loaded-models;
        ValueError with the numbers when it cannot fit beside the pinned ones."""
        deadline = time.monotonic() + self.switch_timeout
        while True:  # one at a time: each unload waits, and what is loaded and wanted changes meanwhile
            loaded = self._loaded()
            footprints, kept = [s.footprint for s in loaded], self.kept.nbytes(but=model.spec.name)
            if self.budget.fits(model.footprint, footprints, kept):
                return
            if kept and not self.budget.holds(model.footprint, footprints, kept):
                self.kept.drop_oldest(model.spec.name, f"to load {model.spec.name!r}")
                continue
            going = victims(model, loaded, self._wanted(), self.budget.fits)
            if not going:
                raise ValueError(self.budget.refusal(model.footprint, [s.footprint for s in loaded if s.pinned]))
            victim = going[0]
            await self._unload(victim, deadline, f"to load {model.spec.name!r}", tenant)
            self.unloads.inc(model_name=victim.spec.name, why="room")

    async def _unload(self, model: PooledModel, deadline: float, why: str, tenant: str | None = None) -> None:
        """Stop `model` taking requests, wait for the other tenants' it runs to end (turns.waits_for), give the
        rest until `deadline`, then shut its engine down (its prefix cache spills to the disk tier)."""
        model.leaving = True
        self._notify()
        try:
            while waits_for(tenant, model.tenants):
                await self._changed.wait()
            while model.users and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
            served, model.served = model.served, None
            assert served is not None
            if model.users:
                log.warning("unloading model %s %s: %d requests still running are cancelled "
                            "(--model-switch-timeout)", model.spec.name, why, model.users)
            left = await self._close(served, max(0.0, deadline - time.monotonic()), keep=True)
            self.kept.keep(model.spec.name, left, model.files, self.budget.weights(model.spec))
            log.info("unloaded model %s %s", model.spec.name, why)
        finally:  # cut short before its close began, the model stays loaded for `shutdown` to close
            model.leaving = False
            self._notify()

    async def _close(self, served: ServedModel, grace_s: float, keep: bool = False) -> Kept | None:
        """Close `served` (`keep`: what it leaves for its next load); a switch cancelled meanwhile leaves the close
        running, for `shutdown` to await."""
        task = asyncio.create_task(served.close(grace_s, keep))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return await asyncio.shield(task)

    # ---- lifecycle ----

    def start(self) -> None:
        if self.ttl > 0:
            self._expiry = asyncio.create_task(self._expire())

    async def _expire(self) -> None:
        """Unload models idle for --model-ttl seconds (switching.expired), one at a time."""
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.ttl / 4)))
            due = expired(self.models.values(), self._wanted(), time.monotonic(), self.ttl)
            if self._switching is None and due:
                self._switching = asyncio.create_task(self._idle_unload(due[0]))

    async def _idle_unload(self, model: PooledModel) -> None:
        try:
            await self._unload(model, time.monotonic(), f"after {self.ttl:g} s idle (--model-ttl)")
            self.unloads.inc(model_name=model.spec.name, why="ttl")
        finally:
            self._switching = None
            self._settle()

    def _settle(self) -> None:
        """A switch is over: what its unloads kept is placed (kept.py), and the waiting requests look again."""
        loaded = self._loaded()
        self.kept.settle({m.spec.name: m.served.engine.serving.admission if m.served.engine.loaded else None
                          for m in loaded if m.served is not None},
                         [m.footprint for m in loaded])
        self._notify()

    async def shutdown(self, grace_s: float) -> None:
        """The daemon's shutdown: a load in progress is cut short (the model it made closed), every model closes."""
        self._closed = True
        self.kept.close()
        if self._expiry is not None:
            self._expiry.cancel()
        if self._switching is not None:
            self._switching.cancel()
            await asyncio.gather(self._switching, return_exceptions=True)
        self._notify()
        await asyncio.gather(*self._closing, *(served.close(grace_s) for served in self.loaded()))
        for model in self.models.values():
            model.served = None
            if model.counter is not None:
                counter, model.counter = model.counter, None
                with contextlib.suppress(Exception):
                    (await counter)[0].close()
