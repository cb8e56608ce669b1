"""What every route reads: the daemon's `Services` (one per process, on the application under SERVICES) and a
model's `ModelState` (its engine, tokenizer and formats), which the services' `Models` hand a request."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from kvfork.backends.base import ModelInfo
from kvfork.backends.vision import folder_family
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.api import EngineError, Scope
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.engine.loop.utilization import TokenRate
from kvfork.server.generate.chat_output import ModelFormats
from kvfork.server.generate.grammar import GrammarCompiler
from kvfork.server.generate.images import Images
from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.origin_guard import OriginGuard
from kvfork.server.guard.slow_clients import SlowClients
from kvfork.server.guard.tenants import key_tenants, KeyTable, request_key
from kvfork.server.settings import without_secrets
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.watch.metrics import Counter, Registry
from kvfork.server.watch.reuse import ReuseLog
from kvfork.server.watch.start_progress import StartProgress


def child_environment() -> dict[str, str]:
    """The environment of a child process that serves no request (the grammar compiler's): the daemon's, less its
    secrets (KVFORK_API_KEY, KVFORK_METRICS_KEY ...)."""
    return without_secrets(os.environ, ServerConfig)


@dataclass(frozen=True)
class ModelBounds:
    """What a request is checked against before its model is acquired: the context it gets, and the vocabulary its
    token ids (logit_bias, stop_token_ids, a prompt of ids) must name (None: checked once the model is loaded)."""

    context: int
    vocab_size: int | None


@dataclass(eq=False)
class ModelState:
    """One model as its requests read it: its engine, the names it answers to, and what is resolved once at its
    load (the tokenizer and its tool-call and reasoning formats, set together by server/launch/model_load.py)."""

    config: ServerConfig
    engine: Engine
    served_names: list[str]
    progress: StartProgress = field(default_factory=StartProgress)  # its load's phase, for /health
    tokenizer: PromptTokenizer | None = None  # set once loaded
    formats: ModelFormats | None = None  # the tokenizer's tool-call and reasoning formats, resolved with it
    _grammars: GrammarCompiler | None = None  # built on the first constrained request

    def close(self, tokenizer: bool = True) -> None:
        """Stop the model's own worker threads: its grammars' and its tokenizer's (unless `tokenizer` is False:
        kept for the model's next load)."""
        if tokenizer and self.tokenizer is not None:
            self.tokenizer.close()
        if self._grammars is not None:
            self._grammars.close()

    def model_name(self, requested: str | None) -> str:
        """The name to answer with; 404 model_not_found for a name we do not serve."""
        if requested is None or requested in self.served_names:
            return requested or self.served_names[0]
        if self.config.accept_any_model:
            return requested
        raise ApiError(404, f"the model {requested!r} does not exist; this server serves "
                       f"{', '.join(repr(n) for n in self.served_names)}", code="model_not_found", param="model")

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.engine.ready and not self.engine.dead

    def require_ready(self) -> PromptTokenizer:
        if not self.ready:
            # why it stopped names the server's paths and libraries: the log has it (and /health, for the
            # holder of --metrics-key)
            reason = "the model runner has stopped; the daemon's log says why" if self.engine.dead \
                else "the model is still loading"
            raise ApiError(503, reason, code="not_ready")
        assert self.tokenizer is not None
        return self.tokenizer

    def require_formats(self) -> ModelFormats:
        """The loaded model's formats (they are resolved with its tokenizer: set whenever it is)."""
        self.require_ready()
        assert self.formats is not None
        return self.formats

    @property
    def info(self) -> ModelInfo:
        """The loaded model's facts (call once ready)."""
        assert self.engine.info is not None
        return self.engine.info

    @property
    def context(self) -> int:
        """Tokens of prompt and output a request may take (--max-context, resolved at load: call once ready)."""
        context = self.engine.config.max_context
        assert context is not None
        return context

    def bounds(self) -> ModelBounds | None:
        """Its context and vocabulary once loaded (ModelBounds); None before."""
        return ModelBounds(self.context, self.info.vocab_size) if self.ready else None

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for the loaded tokenizer (call once ready)."""
        if self._grammars is None:
            assert self.tokenizer is not None
            info = self.info
            self._grammars = GrammarCompiler(self.tokenizer.tokenizer, info.vocab_size, info.eos_token_ids,
                                             self.config.grammar_compile_timeout, child_environment())
        return self._grammars


class Models(Protocol):
    """Where a request's model comes from: the daemon's one (`OneModel`), or a pool of several
    (server/pool/pool.py's `ModelPool`, loading a model on demand)."""

    async def acquire(self, request: web.Request, requested: str | None, stream: bool) -> ModelState:
        """The state of the model a request names, loaded first if need be and held until the request ends."""
        ...

    def known(self, requested: str | None) -> ModelBounds | None:
        """The context and vocabulary of the model a request names, where they are known before the model is
        acquired (a body over them is refused without loading anything); None: checked once it is acquired."""
        ...

    def reads_images(self, requested: str | None) -> bool:
        """Whether the model a request names reads images (its images reach it, not a line of text)."""
        ...

    async def counting(self, request: web.Request, requested: str | None
                       ) -> tuple[PromptTokenizer, ModelFormats, int]:
        """The tokenizer, its formats and the context a request naming `requested` would be counted with
        (count_tokens)."""
        ...

    def recent(self) -> ModelState | None:
        """The model a request used last, if one is loaded."""
        ...

    def engines(self) -> list[Engine]:
        """Every loaded model's engine."""
        ...


class OneModel:
    """The daemon's one model, as `Models`: every request gets it, loaded or not (it says not_ready)."""

    def __init__(self, model: ModelState):
        self.model = model

    async def acquire(self, request: web.Request, requested: str | None, stream: bool) -> ModelState:
        return self.model

    def known(self, requested: str | None) -> ModelBounds | None:
        return self.model.bounds()

    def reads_images(self, requested: str | None) -> bool:
        if self.model.tokenizer is None:  # still loading: its folder says (a request then waits, or hears not_ready)
            return folder_family(self.model.engine.model_path) is not None
        return self.model.tokenizer.vision is not None

    async def counting(self, request: web.Request, requested: str | None
                       ) -> tuple[PromptTokenizer, ModelFormats, int]:
        self.model.model_name(requested)
        return self.model.require_ready(), self.model.require_formats(), self.model.context

    def recent(self) -> ModelState | None:
        return self.model

    def engines(self) -> list[Engine]:
        return [self.model.engine]


@dataclass(eq=False)
class Services:
    """The daemon's own, one per process, whatever model a request names: its flags, keys and guards, metrics,
    the images' decoder, the reuse log, and its `models`."""

    config: ServerConfig
    registry: Registry
    models: Models
    created: int = field(default_factory=lambda: int(time.time()))
    generation_rate: TokenRate = field(default_factory=TokenRate)  # /v1/loads' gen_throughput
    reuse: ReuseLog = field(default_factory=ReuseLog)  # what the reuse page shows (server/watch/reuse.py)
    keys: KeyTable = field(init=False)  # accepted API keys and their tenants; empty: no auth, one tenant
    metrics_keys: KeyTable = field(init=False)  # --metrics-key's, for /metrics and /v1/loads' every figure
    clients: SlowClients = field(init=False)  # the slow-client bounds and their counters
    volatile_lines: Counter = field(init=False)  # server/api/volatile.py's lines taken out of prompts
    origin_guard: OriginGuard = field(init=False)  # which hosts and pages may reach the daemon
    images: Images = field(init=False)  # decoding requests' images (server/generate/images.py)

    def __post_init__(self) -> None:
        self.keys = KeyTable(key_tenants(self.config.api_key, self.config.api_keys_file))
        self.metrics_keys = KeyTable({self.config.metrics_key: ""} if self.config.metrics_key else {})
        self.clients = SlowClients(self.registry, self.config)
        self.volatile_lines = self.registry.counter("volatile_lines_removed_total", "volatile client lines taken "
                                                    "out of prompts (--keep-volatile-lines), by line")
        self.origin_guard = OriginGuard.of(self.config.host, self.config.allowed_hosts, self.config.allowed_origins)
        self.images = Images(self.registry)

    def close(self) -> None:
        """Stop the worker threads the routes use."""
        self.images.close()

    def current(self) -> ModelState:
        """The model a route naming none reads: the one a request used last (503 while none is loaded)."""
        model = self.models.recent()
        if model is None:
            raise ApiError(503, "no model is loaded yet: a request naming one loads it", code="not_ready")
        return model

    def forget_session(self, name: str, tenant: str) -> None:
        """Free a named session's KV state; one still running is left to the engine's LRU."""
        for engine in self.models.engines():
            try:
                engine.delete_session(name, tenant)
            except EngineError:
                pass


SERVICES = web.AppKey("services", Services)
TENANT = web.RequestKey("tenant", str)  # set by the auth middleware


def services_of(request: web.Request) -> Services:
    return request.app[SERVICES]


def tenant_of(request: web.Request) -> str:
    """The tenant whose key authenticated the request ("" without keys)."""
    return request.get(TENANT, "")


def holds_metrics_key(request: web.Request) -> bool:
    """Whether the caller presents --metrics-key (set): it may read every tenant's figures and the server's own
    errors."""
    keys = services_of(request).metrics_keys
    return bool(keys) and keys.tenant(request_key(request.headers.get("Authorization"),
                                                  request.headers.get("x-api-key"))) is not None


def scope_of(request: web.Request, cache_salt: str | None) -> Scope:
    """Whose cached state the request may reuse: its tenant's, split further by its cache_salt
    (validated when the body was decoded: server.api.openai.CacheSalt)."""
    return Scope(tenant_of(request), cache_salt)
