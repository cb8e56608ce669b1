"""Admission on the control loop: who gets a slot, and what state it starts from.

Design rules:
- first come, first served over `inference_slots`; n choices are admitted
  together (n slots, and every choice's bytes at once) or not at all; a head that does not fit the
  KV budget waits (the prefix cache gives way first, then idle named sessions,
  least recently used first), so memory never runs out;
- every byte the engine may come to hold is reserved before it exists: a slot
  reserves the session its request grows to (prompt plus max_tokens, as the
  backend rounds it), a capture slot its snapshot, a parked follower the clone
  it will be handed; named sessions and cache entries count what they hold;
- a named session's state is held by the table while idle, and by its request
  from the moment the request acquires it (even queued, before it runs);
- a clone ordered from the runner stays held until the runner answers the
  order, even when its request stopped waiting for it (it left, or its follow
  timed out): the runner may already have made it;
- bytes are priced by the backend's own cost function (`ModelInfo.kv`, a pure
  function); cache entries count what the backend measured for them; where the
  backend pads the sessions it runs together (MLX), the padding is held too;
- a cache entry evicted while the disk tier is on spills there: its bytes stay
  held (`spilling`) until its file is written, so room it makes comes only then
  (the head waits for it, and the loop admits again when the write is done);
- clone by reference (`KVCost.shares`): each block is counted once, by whoever
  holds it on its own: a running request reserves what it writes (a clone, only
  its own tokens past the blocks it reads: `shared=`), a cache entry or an idle
  named session the bytes the runner measured as its own, and the runner reports
  the rest, the blocks whose writer is gone that others still read (`pooled`).
  Releasing a session frees at once only what nobody else reads (`frees`); what
  others read stays counted (`in_transit`) until the runner reports the Release
  run, when it is in `pooled`.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

from backends.base import ModelInfo
from server.engine import messages as m
from server.engine.api import CapacityExhausted, ContextTooLong, GenerateRequest, InvalidRequest, Scope
from server.engine.config import EngineConfig
from server.engine.disk import DiskTier
from server.engine.prefix_cache import CacheEntry, CacheMatch, PrefixCache
from server.engine.request import Request
from server.engine.scheduler import clamp_max_tokens, fit_admission
from server.engine.sessions import NamedSessions, check_session_id


class Admission:
    def __init__(self, config: EngineConfig, info: ModelInfo, send: Callable[[Any], None]):
        self.config, self.info, self.send = config, info, send
        self.budget: int = config.kv_budget_bytes  # type: ignore[assignment]  (resolved)
        self.queue: collections.deque[Request] = collections.deque()
        windows = [layer.window for layer in info.layers if layer.kind == "sliding" and layer.window]
        self.recurrent = any(layer.kind == "recurrent" for layer in info.layers)
        self.cache = PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes, config.prefix_cache_min_tokens,
                                 windows, self.recurrent, spill=self._spill)
        self.disk: DiskTier | None = None  # the prefix cache's disk tier, when on (the engine opens it)
        self.spilling = 0  # bytes of evicted entries on their way to disk: held until their file is written
        self.named = NamedSessions(config.max_named_sessions)
        self.slots_used = 0
        self.in_slots: dict[int, Request] = {}  # rid -> request holding an inference slot
        self.reserved = 0  # bytes: what requests hold (slots, landed clones), capture slots, abandoned clones
        self.captures_in_use = 0
        # rid -> bytes of each clone it ordered and stopped waiting for, oldest first: the runner may have
        # made it (or may still), so its bytes stay held until the runner's CloneDone answers the order
        self.abandoned: dict[int, collections.deque[int]] = {}
        self.pooled = 0  # bytes the runner reports held by no one session (m.Pooled)
        self.releases_sent = 0
        # (Release number, bytes): what a released session wrote that others read, until that Release has run
        self.in_transit: collections.deque[tuple[int, int]] = collections.deque()

    def check(self, req: GenerateRequest, waiting: int) -> tuple[int, int, int]:
        """Turn away what can never run or cannot wait; else (max_tokens as clamped, bytes choice 0
        reserves, bytes each other choice reserves).

        `waiting`: the queue and the parked followers, who count against --max-queue alike.
        """
        n, context = len(req.prompt), self.config.max_context
        assert context is not None  # resolved
        if n == 0:
            raise InvalidRequest("the prompt holds no tokens")
        if n >= context:
            raise ContextTooLong(f"the prompt has {n} tokens; the context holds {context}, prompt and output together")
        if req.session_id is not None:
            try:
                check_session_id(req.session_id)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        if req.n > self.config.inference_slots:
            raise CapacityExhausted(f"{req.n} choices need {req.n} inference slots; there are "
                                    f"{self.config.inference_slots}")
        if req.n > 1 and req.session_id is not None:
            raise InvalidRequest("a named session runs one choice; send n = 1 with session_id")
        max_tokens = clamp_max_tokens(req.max_tokens, self.config.max_tokens, n, context)
        need = self.request_bytes(n, max_tokens, checkpoints=len(self.checkpoints(req)))
        choice_need = self.choice_bytes(n, max_tokens)
        total = need + (req.n - 1) * choice_need
        rows = req.n * self.info.kv.row_bytes(n + max_tokens)  # each choice a padded row, where rows are padded
        if fit_admission(max(total, rows), 0, 0, self.budget).never:
            raise CapacityExhausted(f"the request needs {max(total, rows)} bytes of KV state; the budget is "
                                    f"{self.budget}")
        waits = bool(self.queue) or self.slots_used + req.n > self.config.inference_slots
        if waits and waiting >= self.config.max_queue:
            raise CapacityExhausted(f"{waiting} requests are already waiting")
        return max_tokens, need, choice_need

    def request_bytes(self, prompt_len: int, max_tokens: int, start: int | None = None, checkpoints: int = 0) -> int:
        """What a request's session grows to: opened at `start` (an empty session 0, a clone its
        `upto`, holding the blocks below it by reference where clones share); None, not yet known:
        the dearest start, empty or a clone of all but the prompt's last token; with the recurrent
        checkpoints it keeps."""
        kv = self.info.kv
        starts = (0, prompt_len - 1) if start is None else (start,)
        return max(kv.bytes_for(prompt_len + max_tokens, shared=kv.shared(at), start=at, checkpoints=checkpoints)
                   for at in starts)

    def checkpoints(self, req: GenerateRequest) -> tuple[int, ...]:
        """Where a request keeps its recurrent state (a model with recurrent layers): its last
        --recurrent-checkpoints message boundaries inside the prompt. Counted in its bytes."""
        if not self.recurrent or self.config.recurrent_checkpoints == 0:
            return ()
        inside = sorted({b for b in req.boundaries if 0 < b < len(req.prompt)})
        return tuple(inside[-self.config.recurrent_checkpoints:])

    def choice_bytes(self, prompt_len: int, max_tokens: int) -> int:
        """What one more choice over a prompt grows to: a clone at the prompt's full length (its own
        tokens only, where clones share)."""
        return self.request_bytes(prompt_len, max_tokens, start=prompt_len)

    def clone_bytes(self, upto: int) -> int:
        """A clone of `[0, upto)`, as it lands (a follower's, or a snapshot): its own bytes."""
        kv = self.info.kv
        return kv.bytes_for(upto, shared=kv.shared(upto), start=upto)

    def held(self) -> int:
        return (self.reserved + self.padding() + self.cache.nbytes + self.named.idle_bytes() + self.pooled
                + sum(nbytes for _, nbytes in self.in_transit) + self.spilling)

    def pooled_now(self, pooled: m.Pooled) -> None:
        """The runner's figure, as of an event: Releases it had run are in it, so their transit ends."""
        self.pooled = pooled.nbytes
        while self.in_transit and self.in_transit[0][0] <= pooled.releases:
            self.in_transit.popleft()

    def padding(self, joining: Sequence[Request] = ()) -> int:
        """Where the backend pads the sessions it runs together to the longest (`KVCost.padded_rows`):
        what the requests in slots (and `joining`, at their `need_bytes`) may hold beyond their own holds,
        each up to the row of the longest session any of them grows to."""
        rows = [*self.in_slots.values(), *joining]
        if not rows or not self.info.kv.padded_rows:
            return 0
        row = self.info.kv.row_bytes(max(len(r.prompt) + r.max_tokens for r in rows))
        joined = {r.rid for r in joining}
        return sum(max(0, row - (r.need_bytes if r.rid in joined else r.reserved_bytes)) for r in rows)

    def can_wait(self, waiting: int) -> bool:
        """Whether one more request may wait (queued or parked) beside `waiting` others."""
        return waiting < self.config.max_queue

    def next(self) -> Request | None:
        """The queue's head, if slots are free for its choices and their bytes fit; they then hold them."""
        if not self.queue:
            return None
        head = self.queue[0]
        choices = [head, *head.waiting_siblings]
        if self.slots_used + len(choices) > self.config.inference_slots:
            return None
        padding = self.padding(choices) - self.padding()
        if not self._hold_together([(r, r.need_bytes) for r in choices], also=padding):
            return None
        self.queue.popleft()
        self.slots_used += len(choices)
        for r in choices:
            self.in_slots[r.rid] = r
        self._offer_capture_slot(head)
        return head

    def requeue(self, request: Request) -> None:
        """Back into the queue at its arrival place: ahead of everyone who came after it."""
        at = next((i for i, queued in enumerate(self.queue) if queued.rid > request.rid), len(self.queue))
        self.queue.insert(at, request)

    def hold(self, request: Request, nbytes: int, also: int = 0) -> bool:
        """Make `request` hold `nbytes` of the budget: more only if it fits (the prefix cache, then idle
        named sessions give way), less always. False (nothing changed) when it does not fit.
        `also`: bytes that must fit beside it (the padding a request joining the slots adds)."""
        return self._hold_together([(request, nbytes)], also)

    def _hold_together(self, holds: list[tuple[Request, int]], also: int = 0) -> bool:
        """All of `holds` (request, bytes), with `also` fitting beside them, or none."""
        extra = sum(nbytes - request.reserved_bytes for request, nbytes in holds)
        if extra + also > 0 and not self._make_room(extra + also):
            return False
        for request, nbytes in holds:
            self.reserved += nbytes - request.reserved_bytes
            request.reserved_bytes = nbytes
        return True

    def hold_named(self, request: Request) -> None:
        """`request` acquired its named session: the state it holds, counted by the table while idle, is
        the request's to hold from now on (queued, it is not idle: nobody may evict it), until it
        hands it back on leaving. A move, not a new byte: it always fits."""
        assert request.named is not None and request.named.busy
        if request.named.session is not None:
            nbytes = request.named.nbytes
            self.reserved += nbytes
            request.reserved_bytes += nbytes

    def let_go(self, request: Request) -> None:
        self.hold(request, 0)

    def abandon_clone(self, request: Request, nbytes: int) -> None:
        """`request` stops waiting for a clone of `nbytes` it ordered from the runner: those bytes move
        from its hold to the order, until `clone_answered`."""
        nbytes = min(nbytes, request.reserved_bytes)
        request.reserved_bytes -= nbytes
        self.abandoned.setdefault(request.rid, collections.deque()).append(nbytes)

    def clone_answered(self, rid: int) -> bool:
        """The runner answered `rid`'s oldest order: if it was abandoned, its bytes go back (True)."""
        orders = self.abandoned.get(rid)
        if not orders:
            return False
        self.reserved -= orders.popleft()
        if not orders:
            del self.abandoned[rid]
        return True

    def _make_room(self, need: int) -> bool:
        idle = self.named.idle_bytes()
        fit = fit_admission(need, self.held(), self.cache.nbytes + idle, self.budget)
        if not fit.admit:
            return False
        if not fit.evict_bytes:
            return True
        # A snapshot's own bytes are never read by another session (a clone of it reads below its own
        # block): evicting it frees them all (a spilled one once its file is written); the pooled blocks
        # it was the last to read go once the runner reports the release.
        spilling = self.spilling
        self.release_sessions(self.cache.evict_bytes(fit.evict_bytes))
        spilled = self.spilling - spilling  # free once written: no named session goes for them
        short = self.budget - (self.held() - spilled) - need
        if short < 0:
            sessions, still_read = self.named.evict_bytes(-short)
            self.release_sessions(sessions, still_read)
        return self.held() + need <= self.budget

    def _spill(self, entry: CacheEntry) -> bool:
        """An evicted entry goes to the disk tier (True), unless the tier is off or has it already."""
        disk = self.disk
        if disk is None or not disk.on or entry.session is None or not disk.worth(entry.tokens, entry.scope):
            return False
        self.spilling += entry.nbytes
        self.send(m.Spill((entry.tokens, entry.scope, entry.nbytes), entry.session))
        return True

    def spilled(self, nbytes: int) -> None:
        """A spill is over (its file written, or not): its bytes go back."""
        self.spilling -= nbytes

    def _offer_capture_slot(self, request: Request) -> None:
        """A capture slot is held from admission, so its snapshot's bytes are in the budget before it exists;
        when none is free the prompt is simply not captured, and nothing waits for it."""
        prompt_len = len(request.prompt)
        if not self.cache.worth_capturing(prompt_len) or self.captures_in_use >= (self.config.capture_slots or 0):
            return
        nbytes = self.clone_bytes(prompt_len)
        if fit_admission(nbytes, self.held(), 0, self.budget).admit:
            self.reserved += nbytes
            self.captures_in_use += 1
            request.capture_slot, request.capture_bytes = True, nbytes

    def free_capture_slot(self, request: Request) -> None:
        if request.capture_slot:
            request.capture_slot = False
            self.captures_in_use -= 1
            self.reserved -= request.capture_bytes

    def free_slot(self, request: Request) -> None:
        """The request no longer holds a slot (it ended, or it was parked): its bytes go back too."""
        self.slots_used -= 1
        self.in_slots.pop(request.rid, None)
        self.let_go(request)

    def store_capture(self, request: Request, tokens: list[int], session: Any, nbytes: int, scope: Scope,
                      kept: tuple[int, ...] = ()) -> None:
        """The snapshot of `request`'s prompt joins the prefix cache. Its recurrent checkpoints came with
        it (`nbytes` counts them): the request's hold lets them go, so no byte is counted twice."""
        if kept:
            self.hold(request, max(0, request.reserved_bytes - len(kept) * self.info.kv.state_bytes))
        self.release_sessions(self.cache.insert(tokens, session, nbytes, scope, kept))

    def release_sessions(self, sessions: list[Any], still_read: int = 0) -> None:
        """Release `sessions`, the engine having stopped counting them; `still_read`: what of their own
        bytes others still read, counted until the runner has run the Release (then it is pooled)."""
        sessions = [s for s in sessions if s is not None]
        if sessions:
            self.send(m.Release(sessions))
            self.releases_sent += 1
            if still_read:
                self.in_transit.append((self.releases_sent, still_read))

    def start(self, request: Request, resume: Any = None, resume_at: int = 0,
              cache_matches: list[CacheMatch] | None = None, donor: tuple[int, int] | None = None) -> m.Start:
        """The Start command for a request that holds a slot: warm resume for a named session,
        else the given `resume` (a follower's landed clone) or `donor` (rid, upto) to clone from,
        else the prefix cache's candidates."""
        named = request.named
        clone_from: list[tuple[Any, int]] = []
        if named is not None:
            if named.resumes(request.prompt, request.req.scope):
                resume, resume_at = named.session, len(named.tokens)
                named.take()  # the request owns it now; it comes back at the end
            else:
                self.release_sessions(*named.take())
        elif resume is None and donor is None:
            request.cache_matches = (self.cache.lookup(request.prompt, request.req.scope) if cache_matches is None
                                     else cache_matches)
            clone_from = [(match.entry.session, match.upto) for match in request.cache_matches]
        choices = [m.Choice(s.rid, s.req.sampling) for s in request.waiting_siblings]
        return m.Start(request.rid, request.prompt, request.req.sampling, request.max_tokens, request.stop_ids,
                       capture=request.capture_slot, keep_session=named is not None,
                       resume=resume, resume_at=resume_at, clone_from=clone_from, donor=donor,
                       constraint=request.req.constraint, choices=choices, keep_at=self.checkpoints(request.req))

    def drain(self) -> list[Any]:
        """Every session the cache and the named sessions hold (for shutdown)."""
        return self.cache.clear() + self.named.clear()
