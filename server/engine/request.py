"""One request as the control loop sees it: its phase, its handle, its accounting.

Phases (one way only):
    QUEUED -> [FOLLOWING or RESTORING ->] STARTING -> RUNNING -> DONE
QUEUED waits for a slot; FOLLOWING is parked, holding no slot, until a
prefilling donor has committed what it needs; RESTORING is parked the same way
until its prefix is read from the disk tier and loaded; STARTING has been handed to the
runner (with a donor to clone from, or not), RUNNING has a session there. Any
phase may jump to DONE.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from server.engine.api import DoneEvent, GenerateRequest, ReuseSource, TokenEvent, Usage
from server.engine.disk import DiskMatch
from server.engine.follow import Following
from server.engine.sessions import NamedSession


class Phase(enum.Enum):
    QUEUED = "queued"
    FOLLOWING = "following"
    RESTORING = "restoring"
    STARTING = "starting"
    RUNNING = "running"
    DONE = "done"


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


@dataclass
class Request:
    rid: int  # admission order, also the runner's key
    req: GenerateRequest
    handle: RequestHandle
    max_tokens: int  # clamped
    stop_ids: frozenset[int]
    need_bytes: int  # what it reserves when it takes a slot (Admission.request_bytes)
    named: NamedSession | None = None
    phase: Phase = Phase.QUEUED
    reserved_bytes: int = 0  # what it holds of the budget now: its slot's bytes, or its landing clone's
    capture_slot: bool = False  # holds a capture slot (and its bytes)
    capture_bytes: int = 0
    cache_matches: list = field(default_factory=list)  # the prefix cache candidates its Start named
    committed: int = 0  # as the runner last published
    kept: tuple[int, ...] = ()  # its session's recurrent checkpoints, as the runner last published
    reused: int = 0
    reuse_source: ReuseSource | None = None
    prefilled: int = 0
    generated: int = 0
    ending: str | None = None  # "cancelled" or "stop": asked for, runner not yet done
    expiry: asyncio.TimerHandle | None = None
    # active reuse and following (reuse.py)
    cached_match: int = 0  # the best prefix-cache match when its reuse was decided
    clone_upto: int = 0  # STARTING with a donor: what the donor clone will hold
    following: Following | None = None  # FOLLOWING: whom, up to where, until when
    registered: bool = False  # its follow order is with the runner
    follow_timer: asyncio.TimerHandle | None = None
    first_parked_at: float = 0.0  # the follow deadline runs from here, across re-parks
    follow_seen: tuple[float, int] = (0.0, 0)  # when it last looked at its leader, and what it had committed
    no_follow: bool = False  # a failed or expired follow: clone-now from then on
    landed: tuple[Any, int] | None = None  # (session, tokens) a follow clone gave it, until it has a slot
    restoring: DiskMatch | None = None  # RESTORING: the disk tier's file it waits for
    restore_sent: bool = False  # its state went to the runner to load: the answer comes back either way
    no_disk: bool = False  # a restore failed: it prefills from then on
    # n > 1: choice 0 is the request that prefills (it lists the others as `siblings`); each other choice
    # (its `lead` set) is admitted with it, holding a slot, and is `sent` to the runner in its Start.
    lead: "Request | None" = None
    siblings: list["Request"] = field(default_factory=list)
    sent: bool = False
    decision: dict[str, Any] = field(default_factory=dict)  # reuse decision and its inputs, for the log line
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt

    @property
    def committed_prompt(self) -> int:
        """Prompt tokens this request's session holds: what a donor can give."""
        return min(self.committed, len(self.req.prompt))

    @property
    def leader(self) -> int | None:
        """Whom it follows, while it follows."""
        return self.following.leader if self.following is not None else None  # type: ignore[return-value]

    @property
    def waiting_siblings(self) -> list["Request"]:
        """Its other choices not yet gone to the runner (nor ended before it)."""
        return [s for s in self.siblings if not s.sent and s.phase is not Phase.DONE]

    @property
    def holds_slot(self) -> bool:
        return self.phase in (Phase.STARTING, Phase.RUNNING)

    def usage(self, now: float) -> Usage:
        started = self.admitted_at or now
        first = self.first_token_at or now
        return Usage(
            prompt_tokens=len(self.req.prompt) if self.lead is None else 0,  # counted once, on choice 0
            reused_tokens=self.reused,
            reuse_source=self.reuse_source,
            prefilled_tokens=self.prefilled,
            generated_tokens=self.generated,
            queue_s=started - self.submitted_at,
            prefill_s=max(0.0, first - started),
            ttft_s=(self.first_token_at - self.submitted_at) if self.first_token_at else 0.0,
            decode_s=max(0.0, now - first) if self.first_token_at else 0.0,
        )
