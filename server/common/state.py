"""What every route reads: the engine, the tokenizer, the names the model answers to."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from kvfork.backends.vision import folder_family
from kvfork.server.api.diagnosis import Fingerprints
from kvfork.server.api.responses.store import ResponseStore
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.api import EngineError, Scope
from kvfork.server.engine.loop.utilization import TokenRate
from kvfork.server.generate.chat_output import ModelFormats
from kvfork.server.generate.grammar import GrammarCompiler
from kvfork.server.generate.images import Images
from kvfork.server.guard.errors import ApiError
from kvfork.server.guard.origin_guard import OriginGuard
from kvfork.server.guard.slow_clients import SlowClients
from kvfork.server.guard.tenants import key_tenants, KeyTable, request_key
from kvfork.server.watch.start_progress import StartProgress
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.watch.metrics import Counter, Registry
from kvfork.server.watch.reuse import ReuseLog


@dataclass(frozen=True)
class ModelBounds:
    """What a request is checked against before its model is acquired: the context it gets, and the vocabulary its
    token ids (logit_bias, stop_token_ids, a prompt of ids) must name (None: checked once the model is loaded)."""

    context: int
    vocab_size: int | None


@dataclass
class AppState:
    config: ServerConfig
    engine: Any  # server.engine.loop.engine.Engine, or a test double with its API
    served_names: list[str]
    registry: Registry
    tokenizer: PromptTokenizer | None = None  # set once loaded
    formats: ModelFormats | None = None  # the tokenizer's tool-call and reasoning formats, resolved with it
    progress: StartProgress = field(default_factory=StartProgress)  # the start's phase, for /health
    created: int = field(default_factory=lambda: int(time.time()))
    _grammars: GrammarCompiler | None = None  # built on the first constrained request
    generation_rate: TokenRate = field(default_factory=TokenRate)  # /v1/loads' gen_throughput
    responses: ResponseStore = field(init=False)  # for /v1/responses' previous_response_id
    keys: KeyTable = field(init=False)  # accepted API keys and their tenants; empty: no auth, one tenant
    clients: SlowClients = field(init=False)  # the slow-client bounds and their counters
    fingerprints: Fingerprints = field(init=False)  # cache diagnostics' (server/api/diagnosis.py)
    reuse: ReuseLog = field(default_factory=ReuseLog)  # what the reuse page shows (server/watch/reuse.py)
    volatile_lines: Counter = field(init=False)  # server/api/volatile.py's lines taken out of prompts
    metrics_keys: KeyTable = field(init=False)  # --metrics-key's, for /metrics and /v1/loads' every figure
    origin_guard: OriginGuard = field(init=False)  # which hosts and pages may reach the daemon
    images: Images = field(init=False)  # decoding requests' images (server/generate/images.py)
    pool: Any = None  # several models (server/pool/pool.ModelPool): `engine` is None, `for_model` picks one

    def __post_init__(self) -> None:
        self.responses = ResponseStore(self.config.max_stored_responses, self._forget_session,
                                       self.config.max_stored_response_bytes)
        self.keys = KeyTable(key_tenants(self.config.api_key, self.config.api_keys_file))
        self.metrics_keys = KeyTable({self.config.metrics_key: ""} if self.config.metrics_key else {})
        self.clients = SlowClients(self.registry, self.config)
        self.fingerprints = Fingerprints(self.registry)
        self.volatile_lines = self.registry.counter("volatile_lines_removed_total", "volatile client lines taken "
                                                    "out of prompts (--keep-volatile-lines), by line")
        self.origin_guard = OriginGuard.of(self.config.host, self.config.allowed_hosts, self.config.allowed_origins)
        self.images = Images(self.registry)

    def close(self) -> None:
        """Stop the worker threads (and grammar processes) the routes use."""
        self.images.close()
        self.close_model()

    def close_model(self, tokenizer: bool = True) -> None:
        """Stop the model's own worker threads (its tokenizer's unless `tokenizer` is False: kept for the model's
        next load, its grammars'); a pool's copies share the rest."""
        if tokenizer and self.tokenizer is not None:
            self.tokenizer.close()
        if self._grammars is not None:
            self._grammars.close()

    def reset_grammars(self) -> None:
        """A model's copy of the state compiles grammars for its own tokenizer."""
        self._grammars = None

    async def for_model(self, request: web.Request, requested: str | None, stream: bool = False) -> AppState:
        """The state of the model a request names: this one, unless the daemon serves several (then the
        model's, loaded first if need be and held until the request ends)."""
        return self if self.pool is None else await self.pool.acquire(request, requested, stream)

    def known(self, requested: str | None) -> ModelBounds | None:
        """The context and vocabulary of the model a request names, where they are known before the model is
        acquired (a body over them is refused without loading anything); None: checked once it is acquired."""
        if self.pool is not None:
            return self.pool.known(requested)
        return ModelBounds(self.context, self.engine.info.vocab_size) if self.ready else None

    def reads_images(self, requested: str | None) -> bool:
        """Whether the model a request names reads images (its images reach it, not a line of text)."""
        if self.pool is not None:
            return self.pool.reads_images(requested)
        if self.tokenizer is None:  # still loading: its folder says (a request then waits, or hears not_ready)
            return folder_family(self.engine.model_path) is not None
        return self.tokenizer.vision is not None

    async def counting(self, request: web.Request, requested: str | None
                       ) -> tuple[PromptTokenizer, ModelFormats, int]:
        """The tokenizer, its formats and the context a request naming `requested` would be counted with
        (count_tokens); with
        several models, a model not loaded is not loaded for a count: its tokenizer alone is."""
        if self.pool is not None:
            return await self.pool.counting(request, requested)
        self.model_name(requested)
        return self.require_ready(), self.require_formats(), self.context

    def current(self) -> AppState:
        """The state a route naming no model reads: this one; with several models, that of the model a request
        used last (503 while none is loaded)."""
        if self.pool is None:
            return self
        state = self.pool.recent()
        if state is None:
            raise ApiError(503, "no model is loaded yet: a request naming one loads it", code="not_ready")
        return state

    def engines(self) -> list[Any]:
        """Every loaded model's engine."""
        return [self.engine] if self.pool is None else self.pool.engines()

    def _forget_session(self, name: str, tenant: str) -> None:
        """Free a named session's KV state; one still running is left to the engine's LRU."""
        for engine in self.engines():
            try:
                engine.delete_session(name, tenant)
            except EngineError:
                pass

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
        return self.tokenizer is not None and bool(self.engine.ready) and not self.engine.dead

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
    def context(self) -> int:
        """Tokens of prompt and output a request may take (--max-context, resolved at load)."""
        return self.engine.config.max_context

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for the loaded tokenizer (call once ready)."""
        if self._grammars is None:
            assert self.tokenizer is not None
            info = self.engine.info
            self._grammars = GrammarCompiler(self.tokenizer.tokenizer, info.vocab_size, info.eos_token_ids,
                                             self.config.grammar_compile_timeout)
        return self._grammars


STATE = web.AppKey("state", AppState)
TENANT = web.RequestKey("tenant", str)  # set by the auth middleware


def state_of(request: web.Request) -> AppState:
    return request.app[STATE]


def tenant_of(request: web.Request) -> str:
    """The tenant whose key authenticated the request ("" without keys)."""
    return request.get(TENANT, "")


def holds_metrics_key(request: web.Request) -> bool:
    """Whether the caller presents --metrics-key (set): it may read every tenant's figures and the server's own
    errors."""
    keys = state_of(request).metrics_keys
    return bool(keys) and keys.tenant(request_key(request.headers.get("Authorization"),
                                                  request.headers.get("x-api-key"))) is not None


def scope_of(request: web.Request, cache_salt: str | None) -> Scope:
    """Whose cached state the request may reuse: its tenant's, split further by its cache_salt
    (validated when the body was decoded: server.api.openai.CacheSalt)."""
    return Scope(tenant_of(request), cache_salt)
