"""One request as the control loop sees it: what every phase shares, and a state per phase.

    Queued -> [Following or Restoring -> Queued ->] Prefilling -> Decoding [-> Paused -> Decoding] -> Finished

Queued waits for an inference slot (holding a session a follow clone or a disk read
handed it, if one did); Following is parked, holding no slot, until a prefilling
leader has committed what it needs; Restoring is parked the same way until its
prefix is read from the disk tier and loaded; Prefilling has been handed to the
runner (starting from a donor's clone, or not) and Decoding has sampled its first
token. Paused has given its slot to another tenant's request (fair_share.preempt): the runner keeps its
session, sampler and grammar as they were, and it waits in the queue, holding its bytes, to decode on from
where it stopped. Any phase may end in Finished.

Each transition is one function below, the only place a request changes phase
(tests/engine/test_request_phases.py walks every one of them).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from kvfork.server.engine.api import DoneEvent, GenerateRequest, ReuseSource, TokenEvent, Usage
from kvfork.server.engine.policy.entries import Found, Match
from kvfork.server.engine.cache.sessions import NamedSession
from kvfork.server.engine.policy.follow import FollowOrder


class RequestHandle:
    """What `Engine.submit` returns: an async stream of TokenEvents, then one DoneEvent."""

    def __init__(self, request_id: str, on_cancel: Callable[[], None], on_finish: Callable[[], None]):
        self.request_id = request_id
        self._events: asyncio.Queue = asyncio.Queue()
        self._on_cancel, self._on_finish = on_cancel, on_finish
        self._ending = False  # after cancel() or finish(), no more tokens: only the DoneEvent
        self.done: DoneEvent | None = None  # set once the DoneEvent has been read
        self.reused = 0  # prompt tokens reused, known once it starts (before its first token)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> TokenEvent | DoneEvent:
        while self.done is None:
            event = await self._events.get()
            if isinstance(event, DoneEvent):
                self.done = event
                return event
            if not self._ending:
                return event
        raise StopAsyncIteration

    def put(self, event: TokenEvent | DoneEvent) -> None:
        self._events.put_nowait(event)

    def cancel(self) -> None:
        """The client is gone: the request leaves the batch within one step."""
        self._ending = True
        self._on_cancel()

    def finish(self) -> None:
        """The daemon matched a stop string: end as a normal "stop"."""
        self._ending = True
        self._on_finish()


# ---- the phases ----


@dataclass(frozen=True)
class Landed:
    """A session a waiting request holds already: a follow clone, or a state loaded from disk."""

    sid: int
    upto: int  # tokens it holds


@dataclass
class Queued:
    landed: Landed | None = None


@dataclass
class Following:
    order: FollowOrder  # whom it follows, up to where, until when
    cached: int  # the best prefix cache match when it parked
    seen: tuple[float, int]  # when it last looked at its leader, and the prompt tokens the leader had committed
    registered: bool = False  # its clone order is with the runner
    timer: asyncio.TimerHandle | None = None  # its follow deadline


@dataclass
class Restoring:
    match: Match  # the disk tier's file it waits for
    sent: bool = False  # its state went to the runner to load: the answer comes back either way


@dataclass
class Prefilling:
    cached: int = 0  # the best prefix cache match when it was placed
    donor_upto: int = 0  # its Start clones a donor's [0, donor_upto); 0 once it started (or without one)
    candidates: list[Match] = field(default_factory=list)  # the prefix cache entries its Start named
    started: bool = False  # the runner has its session
    committed: int = 0  # prompt and output positions, as the runner last published
    checkpoints: tuple[int, ...] = ()  # its session's recurrent checkpoints, as the runner last published


@dataclass
class Decoding:
    committed: int = 0
    checkpoints: tuple[int, ...] = ()


@dataclass
class Paused:
    committed: int = 0
    checkpoints: tuple[int, ...] = ()


@dataclass
class Finished:
    reason: str
    error: str | None = None


Phase = Queued | Following | Restoring | Prefilling | Decoding | Paused | Finished
Waiting = (Queued, Following, Restoring)  # holding no slot, nothing with the runner
InSlot = (Prefilling, Decoding)  # holding a slot, with the runner
_Holding = TypeVar("_Holding", Decoding, Paused)  # a phase whose session the runner holds
WithRunner = (Prefilling, Decoding, Paused)  # the runner holds its session


@dataclass
class Tried:
    """What placing it has learnt, kept across phases."""

    no_follow: bool = False  # a failed or expired follow (or n > 1): clone-now from then on
    no_disk: bool = False  # a restore failed: it prefills from then on
    first_parked_at: float = 0.0  # the follow deadline runs from here, across re-parks


@dataclass(eq=False)
class Request:
    rid: int  # admission order, also the runner's key
    req: GenerateRequest
    handle: RequestHandle
    max_tokens: int  # clamped
    stop_ids: frozenset[int]
    need_bytes: int  # what it reserves when it takes a slot (Admission.request_bytes)
    named: NamedSession | None = None
    phase: Phase = field(default_factory=Queued)
    tried: Tried = field(default_factory=Tried)
    ending: str | None = None  # "cancelled" or "stop": asked for, runner not yet done
    expiry: asyncio.TimerHandle | None = None  # the queue timeout, while it waits
    # n > 1: choice 0 is the request that prefills (it lists the others as `siblings`); each other choice
    # (its `parent` is choice 0) is admitted with it, holding a slot, and is `sent` to the runner in its Start.
    parent: "Request | None" = None
    siblings: list["Request"] = field(default_factory=list)
    sent: bool = False
    decision: dict[str, Any] = field(default_factory=dict)  # reuse decision and its inputs, for the log line
    # Index.best for its prompt (no disk tier), looked up as admission made room for it, less what gave way:
    # its placement starts from it instead of walking the index again (None: admitting it evicted nothing)
    found: Found | None = None
    # usage
    reused: int = 0
    reuse_source: ReuseSource | None = None
    images_encoded: int = 0
    prefilled: int = 0
    generated: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt

    @property
    def holds_slot(self) -> bool:
        return isinstance(self.phase, InSlot)

    @property
    def landed(self) -> Landed | None:
        """The session a clone or a disk read landed for it while it waited, once it is queued again."""
        return self.phase.landed if isinstance(self.phase, Queued) else None

    @property
    def committed(self) -> int:
        """Prompt and output positions its session holds, as the runner last published (0 while waiting)."""
        return self.phase.committed if isinstance(self.phase, InSlot) else 0

    @property
    def committed_prompt(self) -> int:
        """Prompt tokens its session holds: what it can give as a donor or a leader."""
        return min(self.committed, len(self.prompt))

    @property
    def waiting_siblings(self) -> list["Request"]:
        """Its other choices not yet gone to the runner (nor ended before it)."""
        return [s for s in self.siblings if not s.sent and not isinstance(s.phase, Finished)]

    def usage(self, now: float) -> Usage:
        started = self.admitted_at or now
        first = self.first_token_at or now
        return Usage(
            prompt_tokens=len(self.req.prompt) if self.parent is None else 0,  # counted once, on choice 0
            reused_tokens=self.reused,
            reuse_source=self.reuse_source,
            prefilled_tokens=self.prefilled,
            generated_tokens=self.generated,
            images_encoded=self.images_encoded,
            queue_s=started - self.submitted_at,
            prefill_s=max(0.0, first - started),
            ttft_s=(self.first_token_at - self.submitted_at) if self.first_token_at else 0.0,
            decode_s=max(0.0, now - first) if self.first_token_at else 0.0,
            decision=self.decision,
        )


# ---- the transitions: each the one way into its phase ----


class WrongPhase(AssertionError):
    """A transition from a phase it does not leave from: an engine bug."""


def _leave(r: Request, *allowed: type) -> None:
    if not isinstance(r.phase, allowed):
        raise WrongPhase(f"request {r.rid} cannot go from {type(r.phase).__name__}")


def queue(r: Request, landed: Landed | None = None) -> Queued:
    """Back to waiting for a slot (from parking), with the session that landed for it, if any."""
    _leave(r, Queued, Following, Restoring)
    r.phase = Queued(landed)
    return r.phase


def follow(r: Request, order: FollowOrder, cached: int, now: float, leader_committed: int) -> Following:
    """Park behind a leader, holding no slot (`leader_committed`: the prompt tokens it holds now)."""
    _leave(r, Queued)
    r.tried.first_parked_at = r.tried.first_parked_at or now
    r.phase = Following(order, cached, (now, leader_committed))
    return r.phase


def restore(r: Request, match: Match) -> Restoring:
    """Park until its prefix is read from disk and loaded, holding no slot."""
    _leave(r, Queued)
    r.phase = Restoring(match)
    return r.phase


def prefill(r: Request, cached: int = 0, donor_upto: int = 0, candidates: list[Match] | None = None) -> Prefilling:
    """Handed to the runner, holding a slot (also: a choice going with its parent; again: a start whose donor
    clone was refused)."""
    _leave(r, Queued, Prefilling)
    r.phase = Prefilling(cached, donor_upto, candidates or [])
    return r.phase


def started(r: Request, reused: int) -> Prefilling:
    """The runner has its session, holding `reused` prompt tokens."""
    _leave(r, Prefilling)
    assert isinstance(r.phase, Prefilling)
    r.phase.started, r.phase.donor_upto, r.phase.committed = True, 0, reused
    return r.phase


def _hand_on(r: Request, source: type[Prefilling | Decoding | Paused], into: type[_Holding]) -> _Holding:
    """From `source` into `into`, with what the runner last published of its session."""
    _leave(r, source)
    held = r.phase
    assert isinstance(held, (Prefilling, Decoding, Paused))
    r.phase = phase = into(held.committed, held.checkpoints)
    return phase


def decode(r: Request) -> Decoding:
    """Its first token is sampled."""
    return _hand_on(r, Prefilling, Decoding)


def pause(r: Request) -> Paused:
    """It gives its slot to another tenant's request; the runner keeps its session as it is."""
    return _hand_on(r, Decoding, Paused)


def resume(r: Request) -> Decoding:
    """It has a slot again, and decodes on."""
    return _hand_on(r, Paused, Decoding)


def finish(r: Request, reason: str, error: str | None = None) -> Finished:
    """Over: from any phase but Finished."""
    if isinstance(r.phase, Finished):
        raise WrongPhase(f"request {r.rid} is already finished")
    r.phase = Finished(reason, error)
    return r.phase
