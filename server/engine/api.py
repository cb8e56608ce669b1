"""What the daemon hands the engine and what it gets back.

The daemon tokenizes, submits a `GenerateRequest`, and reads `TokenEvent`s then
one `DoneEvent` from the returned handle. Text concerns (detokenizing, stop
strings, tool-call parsing) stay in the daemon: when it matches a stop string it
calls `handle.finish()`, which ends the request as a normal `stop`. A grammar the output must
follow reaches the engine as a `Constraint` (server/generate/grammar.py fills in the two protocols;
the runner's worker/constraints.py drives them). The engine counts into the `MetricRegistry` it is
handed; the daemon's watch room renders it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Protocol

import numpy as np

from kvfork.backends.base import SamplingParams
from kvfork.backends.vision import ImageInput

FinishReason = Literal["stop", "length", "cancelled", "error"]
ReuseSource = Literal["cache", "donor", "session", "disk"]


class TokenMatcher(Protocol):
    def advance(self, token: int) -> None:
        """Consume a committed token (one the last mask allowed)."""

    def fill_mask(self, out: np.ndarray) -> str | None:
        """Write the next token's packed bitmask into `out`; return why no token is legal, or None."""

    def fork(self) -> "TokenMatcher":
        """An independent copy at the same point (n > 1 choices, a cloned request)."""

    # Optional (speculative decoding): `validate(tokens) -> int`, how many leading tokens the grammar
    # accepts from here, the matcher unchanged. A matcher without it gets no drafts.


class Constraint(Protocol):
    def matcher(self) -> TokenMatcher:
        """A fresh matcher at the grammar's start."""


MetricLabels = tuple[tuple[str, str], ...]


class CounterMetric(Protocol):
    values: dict[MetricLabels, float]  # by labels

    def inc(self, amount: float = 1.0, **labels: str) -> None: ...
    def get(self, **labels: str) -> float: ...


class HistogramMetric(Protocol):
    def observe(self, value: float) -> None: ...


class MetricRegistry(Protocol):
    """Where the engine reports what it counts: the daemon's registry (server/watch/metrics.py's `Registry`),
    which `/metrics` renders. A gauge or a counter view is read when rendered."""

    def counter(self, name: str, help: str) -> CounterMetric: ...
    def histogram(self, name: str, help: str, buckets: tuple[float, ...]) -> HistogramMetric: ...
    def gauge(self, name: str, help: str, read: Callable[[], float], labels: MetricLabels = ()) -> object: ...
    def counter_view(self, name: str, help: str, read: Callable[[], float], labels: MetricLabels = ()) -> object: ...


class EngineError(Exception):
    """A request the engine turns away; `code` and `status` map onto the API's error shape."""

    code = "engine_error"
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class CapacityExhausted(EngineError):
    code, status = "capacity_exhausted", 429


class SessionBusy(EngineError):
    code, status = "session_busy", 409


class ContextTooLong(EngineError):
    code, status = "context_length_exceeded", 400

    def __init__(self, tokens: int, context: int, counted: bool = True):
        """`tokens`: the prompt's tokens, or, `counted` False, a lower bound of them (a long prompt refused on
        its prefix: server/text/tokenizer.py)."""
        at_least = "" if counted else "at least "
        super().__init__(f"the prompt has {at_least}{tokens} tokens; the context holds {context}, prompt and output "
                         "together")
        self.tokens, self.context = tokens, context


class NotReady(EngineError):
    code, status = "not_ready", 503


class InvalidRequest(EngineError):
    code, status = "invalid_request_error", 400


# Isolation: a request reuses only state computed under its own scope (the
# tenant whose API key authenticated it, split further by its `cache_salt`),
# whatever the kind of reuse: prefix cache, donor, leader, named session. A
# shared cache is a timing side channel (CVE-2025-46570): another scope's
# prompt must not make this one's first token come sooner.
@dataclass(frozen=True)
class Scope:
    tenant: str = ""  # "": the one tenant of a daemon without API keys
    salt: str | None = None  # the request's cache_salt

    @property
    def tenant_hash(self) -> str:
        """What logs name the tenant by: never its name or key."""
        return hashlib.sha256(self.tenant.encode()).hexdigest()[:12]

    def digest(self, key: bytes) -> str:
        """The scope as the index, the disk tier's files and KV events name it: an HMAC under the daemon's
        `key` (disk.tier_secret), never the tenant's name (it may be an API key) nor a plain hash of it,
        from which a weak name or key could be guessed offline."""
        return hmac.new(key, json.dumps([self.tenant, self.salt]).encode(), hashlib.sha256).hexdigest()[:32]


@dataclass
class GenerateRequest:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int  # 0: the engine's --max-tokens; always clamped to the context left after the prompt
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    session_id: str | None = None  # named session: warm resume, never a reuse recipient
    constraint: Constraint | None = None  # a grammar the output must follow (server/generate/grammar.py makes them)
    scope: Scope = Scope()  # whose state it may reuse; a session_id names a session of scope.tenant
    # Token offsets in `prompt` where a message ends (the chat renderer's): where a model with recurrent
    # layers keeps checkpoints (--recurrent-checkpoints), for a later prompt that shares them.
    boundaries: tuple[int, ...] = ()
    n: int = 1  # choices: the prompt is prefilled once, choice i samples with seed + i (Engine.submit_choices)
    # The images whose keys the prompt holds (backends/vision/keys.py), in order: a model that reads images
    # encodes those its start did not reuse (Backend.encode_images)
    images: tuple[ImageInput, ...] = ()


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s sampling: its own stream, seed + index (as `stream_seed` normalizes seeds),
    so choice 0 is the n = 1 answer; without a seed every stream is drawn fresh."""
    if index == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.stream_seed + index) % 2**64)  # type: ignore[operator]


@dataclass
class Usage:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reuse_source: ReuseSource | None = None
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    images_encoded: int = 0  # images of the prompt the vision tower ran for (the rest: reused or cached)
    decision: dict = field(default_factory=dict)  # the placement's decision and its inputs (the log line's)


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class DoneEvent:
    finish_reason: FinishReason
    usage: Usage = field(default_factory=Usage)
    error: str | None = None  # set when finish_reason == "error"
    grammar_failed: bool = False  # the error is the request's own grammar's (llguidance's limits, or no token
    #                               allowed): the client's input, not the engine's failure
    gave_way: bool = False  # turned away while queued, for a tenant below its share of a full queue (a 429)
