"""Admission: the KV budget and the queue, on the control loop.

Its verbs are the only way in (its parts are private: tests/house/test_engine_boundary.py):
  check(req, waiting) -> Sizes        turn away what can never run or cannot wait (can_wait: may one more wait)
  enqueue(r) / requeue(r) / withdraw(r) / next() -> r | None     the queue, in fair shares between tenants
  give_way(tenant) -> r | None        at a full queue, the waiting request that gives way to `tenant`'s
  to_pause() -> r | None / pause(r)   the running request that gives its slot to a tenant below its share
  reserve(r, nbytes) -> bool          hold more of the budget only if it fits (the cache gives way), less always
  leave_slot(r) / let_go(r) / release(r)    give back a slot and its bytes / the bytes / everything
  take_named(r, nbytes)               a named session's state becomes its request's to hold
  lend(key, nbytes, call_back) -> end | None   lend bytes no one holds to something outside the engine
                                      (loans.py), called back before anything else gives way
  capture_done(r)                     a capture's bytes go back
  keep_snapshot(...) / release_sessions(sids) / drain()    what joins the prefix cache / what the runner
                                      releases / everything, at shutdown
  request_bytes, choice_bytes, clone_bytes, checkpoints     prices (the backend's KVCost)
  held(), holds(r), in_slot(r), has_capture(r), budget, reserved, queued, paused, queued_tokens, slots_used,
  captures_in_use, lent              reads (Engine.stats(), metrics)

What the runner holds beyond those holders (pooled blocks, releases in transit, abandoned orders, spilling
entries) is counted by the LoopLedger (ledger.py) that Serving hands it and enters the runner's answers in;
`held()` counts its `nbytes`, and Admission enters its own releases and spills there.

Design rules:
- fair shares between tenants (fair_share.py), first come, first served within
  a tenant, over `inference_slots`; a tenant above its share pauses a decoding request for
  one below its own (`to_pause`): the paused request keeps its bytes, waits in the queue at
  its arrival place, and takes them back with its next slot (no new byte); n choices are admitted
  together (n slots, and every choice's bytes at once) or not at all; a head that does not fit the
  KV budget waits (the prefix cache gives way first, then idle named sessions,
  least recently used first), so memory never runs out;
- every byte the engine may come to hold is reserved before it exists: a slot
  reserves the session its request grows to (prompt plus max_tokens, as the
  backend rounds it), a capture its snapshot, a parked follower the clone
  it will be handed; named sessions and cache entries count what they hold;
- a named session's state is held by the table while idle, and by its request
  from the moment the request acquires it (even queued, before it runs);
- a clone ordered from the runner stays held until the runner answers the
  order, even when its request stopped waiting for it (it left, or its follow
  timed out): the runner may already have made it (the request's hold moves to
  the ledger's `abandoned`);
- bytes are priced by the backend's own cost function (`ModelInfo.kv`, a pure
  function); cache entries count what the backend measured for them; where the
  backend pads the sessions it runs together (MLX), the padding is held too;
- a cache entry evicted while the disk tier is on spills there: its bytes stay
  held (the ledger's `spilling`) until its file is written, so room it makes
  comes only then (the head waits for it, and the loop admits again when the
  write is done);
- clone by reference (`KVCost.shares`): each block is counted once, by whoever
  holds it on its own: a running request reserves what it writes (a clone, only
  its own tokens past the blocks it reads: `shared=`), a cache entry or an idle
  named session the bytes the runner measured as its own, and the runner reports
  the rest, the blocks whose writer is gone that others still read (the ledger's
  `pooled`). Releasing a session frees at once only what nobody else reads
  (`frees`); what others read stays counted (the ledger's `in_transit`) until
  the runner reports the ReleaseSessions run, when it is pooled.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from kvfork.backends.base import ModelInfo
from kvfork.backends.vision.keys import image_tokens
from kvfork.server.engine import messages as m
from kvfork.server.engine.api import CapacityExhausted, ContextTooLong, GenerateRequest, InvalidRequest, Scope
from kvfork.server.engine.cache.disk import DiskTier
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.policy.entries import Entry
from kvfork.server.engine.cache.sessions import NamedSessions, check_session_id
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.ledger import LoopLedger
from kvfork.server.engine.loop.loans import Loans
from kvfork.server.engine.loop.request import Decoding, Paused, Request
from kvfork.server.engine.policy.fair_share import give_way, next_in_line, preempt
from kvfork.server.engine.policy.scheduler import clamp_max_tokens, fit_admission


@dataclass(frozen=True)
class Sizes:
    max_tokens: int  # as clamped
    need: int  # bytes choice 0 reserves when it takes a slot
    choice_need: int  # bytes each other choice reserves


class Admission:
    def __init__(self, config: EngineConfig, info: ModelInfo, index: Index, named: NamedSessions,
                 disk: DiskTier | None, send: Callable[[Any], None], ledger: LoopLedger):
        self._config, self._kv, self._recurrent, self._info = config, info.kv, info.recurrent, info
        self._budget: int = config.kv_budget_bytes  # type: ignore[assignment]  # resolved
        self._index, self._named, self._disk, self._send, self._ledger = index, named, disk, send, ledger
        self._queue: collections.deque[Request] = collections.deque()
        self._in_slots: dict[int, Request] = {}  # rid -> request holding an inference slot
        self._holds: dict[int, int] = {}  # rid -> bytes it holds: its slot's, or its landing clone's
        self._captures: dict[int, int] = {}  # rid -> bytes of the snapshot its capture may take
        self._reserved = 0  # what requests and captures hold
        self._loans = Loans()  # lent while no one here needs them

    # ---- reads ----

    @property
    def budget(self) -> int:
        return self._budget

    @property
    def queued(self) -> int:
        """Requests waiting for their first slot (a paused one was admitted: not counted against --max-queue)."""
        return len(self._queue) - self.paused

    @property
    def paused(self) -> int:
        """Paused requests, waiting to decode on."""
        return sum(1 for r in self._queue if isinstance(r.phase, Paused))

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the queued requests: prefill work not started."""
        return sum(len(r.prompt) for r in self._queue if not isinstance(r.phase, Paused))

    @property
    def slots_used(self) -> int:
        return len(self._in_slots)

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def captures_in_use(self) -> int:
        return len(self._captures)

    @property
    def lent(self) -> int:
        return self._loans.nbytes

    def held(self) -> int:
        return (self._reserved + self._padding() + self._index.nbytes("memory") + self._named.idle_bytes()
                + self._ledger.nbytes + self._loans.nbytes)

    def in_slot(self, request: Request) -> bool:
        return request.rid in self._in_slots

    def holds(self, request: Request) -> int:
        return self._holds.get(request.rid, 0)

    def has_capture(self, request: Request) -> bool:
        return request.rid in self._captures

    # ---- turning away ----

    def check(self, req: GenerateRequest, waiting: int) -> Sizes:
        """Turn away what can never run or cannot wait (`waiting`: queued and parked alike, against --max-queue)."""
        n, context = len(req.prompt), self._config.max_context
        assert context is not None  # resolved
        if n == 0:
            raise InvalidRequest("the prompt holds no tokens")
        if n >= context:
            raise ContextTooLong(n, context)
        if req.session_id is not None:
            try:
                check_session_id(req.session_id)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        if req.n > self._config.inference_slots:
            raise CapacityExhausted(f"{req.n} choices need {req.n} inference slots; there are "
                                    f"{self._config.inference_slots}")
        if req.n > 1 and req.session_id is not None:
            raise InvalidRequest("a named session runs one choice; send n = 1 with session_id")
        max_tokens = clamp_max_tokens(req.max_tokens, self._config.max_tokens, n, context)
        need = self.request_bytes(n, max_tokens, None, len(self.checkpoints(req)), image_tokens(req.prompt))
        sizes = Sizes(max_tokens, need, self.choice_bytes(n, max_tokens))
        total = sizes.need + (req.n - 1) * sizes.choice_need
        rows = req.n * self._kv.row_bytes(n + max_tokens)  # each choice a padded row, where rows are padded
        if fit_admission(max(total, rows), 0, 0, self._budget).never:
            raise CapacityExhausted(f"the request needs {max(total, rows)} bytes of KV state; the budget is "
                                    f"{self._budget}")
        waits = bool(self._queue) or self.slots_used + req.n > self._config.inference_slots
        if waits and waiting >= self._config.max_queue:
            raise CapacityExhausted(f"{waiting} requests are already waiting")
        return sizes

    def can_wait(self, waiting: int) -> bool:
        """Whether one more request may wait (queued or parked) beside `waiting` others."""
        return waiting < self._config.max_queue

    # ---- prices ----

    def request_bytes(self, prompt_len: int, max_tokens: int, start: int | None = None, checkpoints: int = 0,
                      images: int = 0) -> int:
        """What a request's session grows to: opened at `start` (an empty session 0, a clone its `upto`, holding
        the blocks below it by reference where clones share); None, not yet known: the dearest start, empty or a
        clone of all but the prompt's last token; with its recurrent checkpoints and its prefill's image tokens."""
        kv, pinned = self._kv, images * self._info.image_token_bytes
        starts = (0, prompt_len - 1) if start is None else (start,)
        return pinned + max(kv.bytes_for(prompt_len + max_tokens, shared=kv.shared(at), start=at,
                                         checkpoints=checkpoints) for at in starts)

    def checkpoints(self, req: GenerateRequest) -> tuple[int, ...]:
        """Where a request keeps its recurrent state (a model with recurrent layers): its last
        --recurrent-checkpoints message boundaries inside the prompt. Counted in its bytes."""
        if not self._recurrent or self._config.recurrent_checkpoints == 0:
            return ()
        inside = sorted({b for b in req.boundaries if 0 < b < len(req.prompt)})
        return tuple(inside[-self._config.recurrent_checkpoints:])

    def choice_bytes(self, prompt_len: int, max_tokens: int) -> int:
        """One more choice over a prompt: a clone at its full length (its own tokens only, where clones share)."""
        return self.request_bytes(prompt_len, max_tokens, start=prompt_len)

    def clone_bytes(self, upto: int) -> int:
        """A clone of `[0, upto)`, as it lands (a follower's, or a snapshot): its own bytes."""
        return self._kv.bytes_for(upto, shared=self._kv.shared(upto), start=upto)

    # ---- the queue ----

    def enqueue(self, request: Request) -> None:
        self._queue.append(request)

    def requeue(self, request: Request) -> None:
        """Back into the queue at its arrival place: ahead of everyone who came after it."""
        at = next((i for i, queued in enumerate(self._queue) if queued.rid > request.rid), len(self._queue))
        self._queue.insert(at, request)

    def give_way(self, tenant: str) -> Request | None:
        """The queue is full: the newest queued request of the tenant furthest above its share, when `tenant` is
        below its own (fair_share.give_way); the caller turns it away. None: `tenant`'s request is refused."""
        queued = [r for r in self._queue if not isinstance(r.phase, Paused)]  # a paused one never gives way
        victim = give_way(collections.Counter(r.req.scope.tenant for r in queued), tenant, self._config.max_queue)
        return next((r for r in reversed(queued) if r.req.scope.tenant == victim), None)

    def to_pause(self) -> Request | None:
        """The running request that pauses so the next in line gets a slot (fair_share.preempt): the newest
        decoding request of the tenant furthest above its share, when the next in line's tenant is below its
        own, no slot is free for its choices, and its bytes would fit. None: nobody pauses."""
        at = next_in_line([r.req.scope.tenant for r in self._queue], self._tenants_in_slots())
        if at is None:
            return None
        head = self._queue[at]
        short = self.slots_used + 1 + len(head.waiting_siblings) - self._config.inference_slots
        if short <= 0 or not self._would_fit(head):
            return None
        pausable = [r for r in self._in_slots.values() if isinstance(r.phase, Decoding) and not r.ending]
        slots, tenant = self._config.inference_slots, head.req.scope.tenant
        held, left = self._tenants_in_slots(), collections.Counter(r.req.scope.tenant for r in pausable)
        victims = []
        while len(victims) < short and (victim := preempt(held, tenant, slots, +left)) is not None:
            victims.append(victim)  # the pauses its choices need, as the policy would make them one by one
            held[victim], left[victim], held[tenant] = held[victim] - 1, left[victim] - 1, held[tenant] + 1
        if len(victims) < short:
            return None  # pausing could not give it every slot it needs: nobody pauses for nothing
        return max((r for r in pausable if r.req.scope.tenant == victims[0]), key=lambda r: r.rid)

    def pause(self, request: Request) -> None:
        """It gives its slot up and waits at its arrival place, holding its bytes (its session stays whole)."""
        del self._in_slots[request.rid]
        self.requeue(request)

    def _would_fit(self, head: Request) -> bool:
        """Whether the bytes `head` and its choices take with a slot fit now (the cache and idle named sessions
        giving way), nothing evicted yet."""
        extra = sum(self._slot_bytes(r) - self.holds(r) for r in [head, *head.waiting_siblings])
        return fit_admission(extra, self.held() - self._ledger.freeing, self._evictable(), self._budget).admit

    def _evictable(self) -> int:
        reads = self._ledger.reclaimable(self._index.reads("memory"))
        return self._index.nbytes("memory") + reads + self._named.idle_bytes() + self._loans.nbytes

    def _slot_bytes(self, request: Request) -> int:
        """What it holds with a slot: its reservation, or, paused, what it held before."""
        return self.holds(request) if isinstance(request.phase, Paused) else request.need_bytes

    def _tenants_in_slots(self) -> collections.Counter[str]:
        return collections.Counter(r.req.scope.tenant for r in self._in_slots.values())

    def withdraw(self, request: Request) -> None:
        """Out of the queue, if it is in."""
        if request in self._queue:
            self._queue.remove(request)

    def next(self) -> Request | None:
        """The next in line (fair_share.next_in_line), if slots are free for its choices and their bytes fit;
        they then hold them. One that does not fit waits, and those behind it too (no big request starves)."""
        at = next_in_line([r.req.scope.tenant for r in self._queue], self._tenants_in_slots())
        if at is None:
            return None
        head = self._queue[at]
        choices = [head, *head.waiting_siblings]
        if self.slots_used + len(choices) > self._config.inference_slots:
            return None
        padding, head.found = self._padding(choices) - self._padding(), None
        if not self._hold_together([(r, self._slot_bytes(r)) for r in choices], also=padding, admitting=head):
            return None
        del self._queue[at]
        for r in choices:
            self._in_slots[r.rid] = r
        if not isinstance(head.phase, Paused):  # a paused request's prompt is in: nothing to capture
            self._offer_capture(head)
        return head

    # ---- holding bytes ----

    def reserve(self, request: Request, nbytes: int) -> bool:
        """Make `request` hold `nbytes` of the budget: more only if it fits (the prefix cache, then idle
        named sessions give way), less always. False (nothing changed) when it does not fit."""
        return self._hold_together([(request, nbytes)])

    def let_go(self, request: Request) -> None:
        """It holds no bytes from now on (its slot, if any, stays)."""
        self.reserve(request, 0)

    def leave_slot(self, request: Request) -> None:
        """It parks: its slot, its capture and its bytes go back."""
        self._in_slots.pop(request.rid, None)
        self.capture_done(request)
        self.let_go(request)

    def release(self, request: Request) -> None:
        """It is over on the loop: everything it holds goes back, and it leaves the queue."""
        self.leave_slot(request)
        self.withdraw(request)
        self._holds.pop(request.rid, None)

    def lend(self, key: Hashable, nbytes: int, call_back: Callable[[], None]) -> Callable[[], None] | None:
        """Lend `nbytes` of the budget to `key`'s holder (loans.py) where no one holds them (nothing is evicted for
        a loan; None: refused); `call_back()` drops what the holder keeps in them when the engine needs the bytes.
        Returns what the holder calls to give them back of its own accord."""
        if not fit_admission(nbytes, self.held(), 0, self._budget).admit:
            return None
        return self._loans.lend(key, nbytes, call_back)

    def take_named(self, request: Request, nbytes: int) -> None:
        """`request` acquired its named session: the `nbytes` of state it keeps, counted by the table while
        idle, are the request's to hold from now on (queued, it is not idle: nobody may evict it), until it
        hands them back on leaving. A move, not a new byte: it always fits."""
        self._reserved += nbytes
        self._holds[request.rid] = self.holds(request) + nbytes

    def _hold_together(self, holds: list[tuple[Request, int]], also: int = 0, admitting: Request | None = None) -> bool:
        """All of `holds` (request, bytes), with `also` fitting beside them, or none (`admitting`: _evict_for)."""
        extra = sum(nbytes - self.holds(request) for request, nbytes in holds)
        if extra + also > 0 and not self._evict_for(extra + also, admitting):
            return False
        for request, nbytes in holds:
            self._reserved += nbytes - self.holds(request)
            self._holds[request.rid] = nbytes
        return True

    def _padding(self, joining: Sequence[Request] = ()) -> int:
        """Where the backend pads the sessions it runs together to the longest (`KVCost.padded_rows`):
        what the requests in slots (and `joining`, at their `need_bytes`) may hold beyond their own holds,
        each up to the row of the longest session any of them grows to."""
        rows = [*self._in_slots.values(), *joining]
        if not rows or not self._kv.padded_rows:
            return 0
        row = self._kv.row_bytes(max(len(r.prompt) + r.max_tokens for r in rows))
        joined = {r.rid for r in joining}
        return sum(max(0, row - (r.need_bytes if r.rid in joined else self.holds(r))) for r in rows)

    def _evict_for(self, need: int, admitting: Request | None = None) -> bool:
        """Make room for `need` more bytes: loans are called back first, then the prefix cache gives way (the
        entries `admitting` could start from last: evicting them would undo its reuse), then idle named sessions.
        False when that would not make room, or the room is pool bytes being freed (LoopLedger.freeing): waits."""
        fit = fit_admission(need, self.held() - self._ledger.freeing, self._evictable(), self._budget)
        if not fit.admit:
            return False
        if not fit.evict_bytes or self._loans.recall(fit.evict_bytes) >= fit.evict_bytes:
            return self.held() + need <= self._budget
        # A snapshot's own bytes are never read by another session: evicting it frees them (a spilled one once
        # written), and the pooled blocks it was the last to read once the runner reports the release (freeing).
        spilling = self._ledger.spilling
        found = self._index.best(admitting.prompt, admitting.req.scope, disk=False) if admitting else None
        dropped = self._index.evict_memory(self.held() - self._ledger.freeing + need - self._budget, found)
        if admitting:
            admitting.found = found and found.without(dropped)  # its placement's lookup (Request.found)
        self._drop_entries(dropped)
        spilled = self._ledger.spilling - spilling  # free once written: no named session goes for them
        short = self._budget - (self.held() - spilled - self._ledger.freeing) - need
        if short < 0:
            self.release_sessions(*self._named.evict_bytes(-short))
        return self.held() + need <= self._budget

    # ---- the runner's sessions ----

    def release_sessions(self, sids: Sequence[int], still_read: int = 0, freeing: int = 0) -> None:
        """Release `sids`, the engine having stopped counting them; `still_read`: what of their own bytes others
        still read, counted until the runner has run the ReleaseSessions (then pooled); `freeing`: LoopLedger's."""
        if sids:
            self._send(m.ReleaseSessions(list(sids)))
            self._ledger.released(still_read, freeing)

    def _drop_entries(self, entries: list[Entry]) -> None:
        """Entries the prefix cache let go: each spills to the disk tier, or is released."""
        released = []
        for entry in entries:
            assert entry.sid is not None
            if self._disk is not None and self._disk.on and self._disk.worth(entry.tokens, entry.scope):
                self._ledger.spill(entry.nbytes)
                self._send(m.Spill((entry.tokens, entry.scope, entry.nbytes), entry.sid))
            else:
                released.append(entry.sid)
        reads = sum(e.reads for e in entries if e.sid in released)  # the blocks they read, pooled or soon
        self.release_sessions(released, freeing=self._ledger.reclaimable(reads))

    # ---- snapshots for the prefix cache ----

    def _offer_capture(self, request: Request) -> None:
        """A capture is held from admission, so its snapshot's bytes are in the budget before it exists;
        when none is free the prompt is simply not captured, and nothing waits for it."""
        prompt_len = len(request.prompt)
        if not self._index.worth_capturing(prompt_len) or self.captures_in_use >= (self._config.max_captures or 0):
            return
        nbytes = self.clone_bytes(prompt_len)
        if fit_admission(nbytes, self.held(), 0, self._budget).admit:
            self._reserved += nbytes
            self._captures[request.rid] = nbytes

    def capture_done(self, request: Request) -> None:
        """Its capture is over (stored, refused, failed) or will not come: its bytes go back."""
        self._reserved -= self._captures.pop(request.rid, 0)

    def keep_snapshot(self, request: Request, tokens: list[int], sid: int, nbytes: int, scope: Scope,
                      kept: tuple[int, ...] = ()) -> None:
        """The snapshot of `request`'s prompt joins the prefix cache. Its recurrent checkpoints came with
        it (`nbytes` counts them): the request's hold lets them go, so no byte is counted twice."""
        if kept:
            self.reserve(request, max(0, self.holds(request) - len(kept) * self._kv.state_bytes))
        stored, evicted = self._index.keep(tokens, sid, nbytes, scope, kept)
        if not stored:
            self.release_sessions([sid])
        self._drop_entries(evicted)

    def drain(self) -> None:
        """Shutdown: the prefix cache spills (or is released), named sessions are released."""
        self._drop_entries([self._index.evict_oldest("memory") for _ in range(self._index.count("memory"))])
        self.release_sessions(self._named.clear())
