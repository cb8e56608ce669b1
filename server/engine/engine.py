"""The engine core: one state machine over requests, on the control loop.

    engine = Engine(backend, model_path, dtype, config, registry)
    await engine.start()                 # the runner thread loads the model
    handle = engine.submit(request)      # sync; raises an EngineError when turned away
    handles = engine.submit_choices(request)  # n > 1: one handle per choice, choice i at index i
    async for event in handle: ...       # TokenEvents, then one DoneEvent
    await engine.shutdown(grace_s)

A request's path: `submit` checks it (Admission.check) and queues it; `_admit`
gives the queue's head a slot; `_place` asks placement.place where it starts
and `_apply` does it: a Start to the runner, or a park (following a leader,
restoring from disk) that comes back to the queue. The runner's events
(`_drain`) move it through its phases (request.py) until its one DoneEvent is
delivered. The engine never calls the backend and never blocks: the runner owns
the model, and each step of it (runner.Runner.step) runs one StepPlan.

Its collaborators are managers with narrow verbs: Admission (budget and queue),
Index (reusable states), NamedSessions, DiskTier; none calls back into the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from kvfork.backends.base import Backend, ModelInfo
from kvfork.backends.model_path import resolve_model
from kvfork.server.engine import messages as m
from kvfork.server.engine import request as phase
from kvfork.server.engine.admission import Admission
from kvfork.server.engine.api import CapacityExhausted, DoneEvent, GenerateRequest, NotReady, TokenEvent, choice_sampling
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.disk import DiskTier, fingerprint, tier_secret
from kvfork.server.engine.drafts import Drafts
from kvfork.server.engine.follow import FollowOrder, at_deadline
from kvfork.server.engine.index import Index
from kvfork.server.engine.load import EngineLoad
from kvfork.server.engine.memory_plan import MemoryPlan
from kvfork.server.engine.placement import (Cached, Clone, Follow, Fresh, Placement, Restore, Resume, View, Wait, place,
                                     place_without_reuse, prefilling, take_view)
from kvfork.server.engine.rates import RateTracker
from kvfork.server.engine.request import Decoding, Following, Landed, Prefilling, Queued, Request, RequestHandle, Restoring
from kvfork.server.engine.runner import Runner
from kvfork.server.engine.sessions import NamedSessions
from kvfork.server.engine.telemetry import EngineMetrics
from kvfork.server.metrics import Registry
from kvfork.server.settings import validate

log = logging.getLogger("kvfork.engine")

STOP_WAIT_S = 10.0  # after the grace period: how long cancelled requests get to leave before we stop waiting


class Engine:
    def __init__(self, backend: Backend, model_path: str, dtype: str | None, config: EngineConfig,
                 registry: Registry, kv_dir: Path | None = None, kv_events: Any = None,
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
        # the managers, once the model is loaded
        self._admission: Admission | None = None
        self._index: Index | None = None
        self._named: NamedSessions | None = None
        self._disk: DiskTier | None = None
        self._requests: dict[int, Request] = {}
        self._followers: dict[int, Request] = {}  # parked behind a leader, in park order
        self._reuse_errors_logged: set[tuple[str, str]] = set()  # (stage, exception type) logged once
        self._rates = RateTracker()  # the cost model's, from the runner's step timings
        self._next_rid = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.stats = m.StepStats({}, 0, 0, 0.0, 0.0)
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
                              c.speculative_max_batch)
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
            if isinstance(r.phase, phase.Waiting):
                self._cancel(r.rid)
        await self._wait_idle(grace_s)
        for rid in list(self._requests):
            self._cancel(rid)
        await self._wait_idle(STOP_WAIT_S)
        for r in list(self._requests.values()):  # the runner is stuck or dead: answer them anyway
            self.complete(r, "cancelled")
        if self._admission is not None:
            self._admission.drain()
        self._runner.send(m.Stop())
        await asyncio.to_thread(self._runner.thread.join, STOP_WAIT_S)
        self._drain()  # the cache's last spills go to the disk tier here
        if self._disk is not None:
            await self._disk.close()  # after the last spills have been answered

    @property
    def runner_alive(self) -> bool:
        return self._runner is not None and self._runner.thread.is_alive()

    async def _wait_idle(self, timeout: float) -> None:
        if self._requests and not self.dead:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                pass

    # ---- what telemetry, tools and tests read (None until the model is loaded) ----

    @property
    def admission(self) -> Admission | None:
        return self._admission

    @property
    def index(self) -> Index | None:
        return self._index

    @property
    def named(self) -> NamedSessions | None:
        return self._named

    @property
    def disk(self) -> DiskTier | None:
        return self._disk

    @property
    def following(self) -> int:
        return len(self._followers)

    def live(self) -> list[Request]:
        """The requests it holds now, in admission order (read, never changed: the reuse page's)."""
        return list(self._requests.values())

    @property
    def rates(self) -> RateTracker:
        """The cost model's measured rates (tools and tests may set a simulated machine's)."""
        return self._rates

    @rates.setter
    def rates(self, tracker: RateTracker) -> None:
        self._rates = tracker

    def requests(self) -> list[Request]:
        return list(self._requests.values())

    def request(self, rid: int) -> Request | None:
        return self._requests.get(rid)

    def load(self) -> EngineLoad:
        """What it carries now (load.py); all zeros until the model is loaded."""
        admission, info, index, named = self._admission, self.info, self._index, self._named
        if admission is None or info is None or index is None or named is None:
            return EngineLoad()
        per_token = max(1, info.kv.full_bytes_per_token)
        pinned = max(0, admission.held() - index.nbytes("memory") - named.idle_bytes())  # what cannot give way
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
        if not self.ready or self._admission is None or self._named is None:
            raise NotReady("the engine is not running" if self.info is not None else "the model is still loading")
        adm = self._admission
        if self.waiting() >= self.config.max_queue and (victim := adm.give_way(req.scope.tenant)) is not None:
            self.complete(victim, "error", "turned away from a full queue for another tenant's request: this "
                          "tenant holds more than its share of --max-queue", gave_way=True)
        sizes = adm.check(req, waiting=self.waiting())
        named = None
        if req.session_id is not None:  # a busy session gives None: the request runs without it
            named, evicted = self._named.acquire(req.session_id, req.scope.tenant)
            adm.release_sessions(*evicted)
        eos = frozenset() if req.ignore_eos else frozenset(self.info.eos_token_ids)  # type: ignore[union-attr]
        r = self._new_request(req, sizes.max_tokens, req.stop_token_ids | eos, sizes.need, named=named)
        r.tried.no_follow = req.n > 1  # its choices hold their slots from admission: it clones now or prefills
        for i in range(1, req.n):
            choice = replace(req, sampling=choice_sampling(req.sampling, i), n=1)
            r.siblings.append(self._new_request(choice, sizes.max_tokens, r.stop_ids, sizes.choice_need, lead=r))
        if named is not None and named.state is not None:
            adm.take_named(r, named.state.nbytes)
        self._idle.clear()
        adm.enqueue(r)
        self._admit()
        if isinstance(r.phase, Queued):
            self._expire_at(r, r.submitted_at + self.config.queue_timeout)
            self._arrive(r)
        if isinstance(r.phase, Following) and not adm.can_wait(self.waiting() - 1):
            # A follower waits like a queued request: it counts against --max-queue when it parks.
            self._withdraw(r)
            raise CapacityExhausted(f"{self.waiting()} requests are already waiting")
        return [r.handle] + [s.handle for s in r.siblings]

    def _new_request(self, req: GenerateRequest, max_tokens: int, stop_ids: frozenset[int], need: int,
                     **kw: Any) -> Request:
        self._next_rid += 1
        rid = self._next_rid
        handle = RequestHandle(req.request_id, lambda: self._cancel(rid), lambda: self._finish(rid))
        r = self._requests[rid] = Request(rid, req, handle, max_tokens, stop_ids, need, **kw)
        return r

    @property
    def recurrent_checkpoints(self) -> int:
        """How many message boundaries a request keeps its recurrent state at: --recurrent-checkpoints
        on a model with recurrent layers, else none (every other state clones anywhere)."""
        if self.info is None or not self.info.recurrent:
            return 0
        return self.config.recurrent_checkpoints

    def waiting(self) -> int:
        """Requests waiting: queued, and parked behind a leader."""
        return (self._admission.queued if self._admission is not None else 0) + len(self._followers)

    def reset_session(self, session_id: str, tenant: str = "") -> bool:
        return self._drop_session(session_id, forget=False, tenant=tenant)

    def delete_session(self, session_id: str, tenant: str = "") -> bool:
        return self._drop_session(session_id, forget=True, tenant=tenant)

    def _drop_session(self, session_id: str, forget: bool, tenant: str) -> bool:
        if self._named is None or self._admission is None:
            return False
        existed, held = self._named.drop(session_id, forget, tenant)
        self._admission.release_sessions(*held)
        return existed

    # ---- admission and placement ----

    def _admit(self) -> None:
        """Give free slots to the queue's head while its bytes fit; each admitted request is placed."""
        adm = self._admission
        if adm is None or self._closing:
            return
        while (r := adm.next()) is not None:
            if r.expiry is not None:
                r.expiry.cancel()
            r.admitted_at = time.monotonic()
            self.metrics.queue_wait.observe(r.admitted_at - r.submitted_at)
            if not adm.has_capture(r) and self._index is not None and self._index.worth_capturing(len(r.prompt)):
                self.metrics.captures.inc(outcome="skipped")
            for sibling in r.waiting_siblings:  # they hold their slots now, and go to the runner with r's Start
                phase.prefill(sibling)
                sibling.admitted_at = r.admitted_at
            self._apply(r, self._place(r, slot=True))

    def _arrive(self, r: Request) -> None:
        """`r` has to wait for a slot: if it would follow a leader, it parks now (holding no slot)."""
        if self.config.active_prefix_reuse_min_tokens > 0 and r.named is None and self.config.follow:
            self._apply(r, self._place(r, slot=False))

    def _place(self, r: Request, slot: bool) -> Placement:
        """Where `r` starts: placement.place over its view. Reuse is optional work: a lookup or a choice
        that raises is logged and counted, and `r` starts from a fresh prefill (or waits for its slot)."""
        try:
            return place(r, self._view(r, slot))
        except Exception as exc:
            self._reuse_failed("placement", exc)
            return place_without_reuse(r, slot)

    def _cached_matches(self, r: Request) -> list:
        """The prefix cache's matches for `r`'s prompt, best first; none when the lookup raises."""
        assert self._index is not None
        try:
            return self._index.best(r.prompt, r.req.scope, disk=False).memory
        except Exception as exc:
            self._reuse_failed("placement", exc)
            return []

    def _reuse_failed(self, stage: str, exc: Exception) -> None:
        """Counted each time; logged with its traceback the first time each stage fails this way."""
        self.metrics.reuse_errors.inc(stage=stage)
        seen = (stage, type(exc).__name__)
        if seen not in self._reuse_errors_logged:
            self._reuse_errors_logged.add(seen)
            log.error("reuse failed (%s); the request prefills instead", stage, exc_info=exc)

    def _view(self, r: Request, slot: bool) -> View:
        assert self._index is not None
        disk = self._disk is not None and self._disk.on
        return take_view(r, self._requests.values(), self._followers.values(), self._index, self._rates.rates,
                         self.config, disk, slot, time.monotonic())

    def _apply(self, r: Request, p: Placement) -> None:
        """Do what `place` decided for `r` (which holds a slot, unless it is a Wait or a Follow on arrival)."""
        if p.log is not None:
            r.decision = p.log
        if p.follow_choice is not None:
            self.metrics.follow.inc(choice=p.follow_choice)
        if p.disk_choice is not None:
            self.metrics.disk_decisions.inc(choice=p.disk_choice)
        match p:
            case Resume(sid=sid, upto=upto, named=named):
                if named:  # the request owns its state now; it comes back at the end
                    self._named.take(r.named)  # type: ignore[union-attr]
                self._start(r, p.cached, resume=(sid, upto))
            case Clone(donor=donor, upto=upto):
                self._start(r, p.cached, donor=(donor, upto))
            case Cached(matches=matches):
                self._start(r, p.cached, candidates=list(matches))
            case Fresh():
                if r.named is not None:  # a named session that does not resume starts cold
                    self._admission.release_sessions(*self._named.take(r.named))  # type: ignore[union-attr]
                self._start(r, p.cached)
            case Follow():
                self._follow(r, p)
            case Restore(match=match):
                self._restore(r, match)
            case Wait():
                pass

    def _start(self, r: Request, cached: int = 0, resume: tuple[int, int] | None = None,
               donor: tuple[int, int] | None = None, candidates: list | None = None) -> None:
        """Hand `r`, which holds a slot, to the runner."""
        assert self._admission is not None and self._index is not None
        adm = self._admission
        phase.prefill(r, cached, donor[1] if donor else 0, candidates)
        for sibling in r.waiting_siblings:
            if sibling.ending:  # a choice that left while its Start was refused leaves now
                self.complete(sibling, sibling.ending)
        choices = [m.Choice(s.rid, s.req.sampling) for s in r.waiting_siblings]
        sid, at = resume if resume is not None else (None, 0)
        self._send(m.Start(r.rid, r.prompt, r.req.sampling, r.max_tokens, r.stop_ids, capture=adm.has_capture(r),
                           keep_session=r.named is not None, resume=sid, resume_at=at,
                           clone_from=[(c.entry.sid, c.upto) for c in candidates or ()], donor=donor,
                           constraint=r.req.constraint, choices=choices, keep_at=adm.checkpoints(r.req),
                           scope=json.dumps([r.req.scope.tenant, r.req.scope.salt])))
        for sibling in r.waiting_siblings:
            sibling.sent = True
        self._index.run(r.rid, r.prompt, r.req.scope, r.rid)
        for f in self._followers.values():  # the clone orders of its followers can go to the runner now
            if isinstance(f.phase, Following) and f.phase.order.leader == r.rid and not f.phase.registered:
                self._register(f)

    def _send(self, command: Any) -> None:
        assert self._runner is not None
        self._runner.send(command)

    def _expire_at(self, r: Request, deadline: float) -> None:
        """(Re)arm the queue timeout of a waiting request, at `deadline` on the monotonic clock."""
        if r.expiry is not None:
            r.expiry.cancel()
        loop = asyncio.get_running_loop()
        r.expiry = loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, r.rid)

    # ---- following a leader ----

    def _follow(self, r: Request, p: Follow) -> None:
        """Park `r` behind `p.leader`, holding the bytes of the clone it will be handed and no slot."""
        adm = self._admission
        assert adm is not None
        if adm.in_slot(r):  # placed at admission: its slot goes back
            adm.leave_slot(r)
            held = adm.reserve(r, adm.clone_bytes(p.target))
            assert held, "a follower's clone costs no more than the slot it gives back"
        elif not adm.reserve(r, adm.clone_bytes(p.target)):  # on arrival: it waits in the queue instead
            return
        adm.withdraw(r)
        now = time.monotonic()
        first = r.tried.first_parked_at or now
        order = FollowOrder.park(r.rid, p.decided, r.rid, first, self.config.follow_max_wait)
        lead = self._requests.get(order.leader)  # type: ignore[arg-type]
        following = phase.follow(r, order, p.cached, now, lead.committed_prompt if lead is not None else 0)
        self._followers[r.rid] = r
        loop = asyncio.get_running_loop()
        following.timer = loop.call_later(max(0.0, order.deadline - now), self._follow_expired, r.rid)
        self._expire_at(r, r.submitted_at + self.config.queue_timeout)  # the same queue timeout as anyone
        if lead is not None and lead.holds_slot:
            self._register(r)

    def _register(self, f: Request) -> None:
        assert isinstance(f.phase, Following)
        f.phase.registered = True
        order = f.phase.order
        self._send(m.CloneDonor(f.rid, order.leader, order.target, order=order.order))  # type: ignore[arg-type]

    def _follow_expired(self, rid: int) -> None:
        f = self._followers.get(rid)
        if f is None or self._still_following(f):
            return
        self._unpark(f)
        f.decision["follow_expired"] = True
        f.tried.no_follow = True
        self._requeue(f)
        self._admit()

    def _still_following(self, f: Request) -> bool:
        """At `f`'s deadline: whether following its (running) leader is still the cheaper way, by the
        leader's progress since `f` last looked (follow.at_deadline); if so the timer is armed again."""
        following = f.phase
        assert isinstance(following, Following)
        lead = self._requests.get(following.order.leader)  # type: ignore[arg-type]
        if lead is None or not lead.holds_slot:
            return False  # a parked leader (a chain) or one on its way: plan again
        now, (seen_at, seen) = time.monotonic(), following.seen
        committed = lead.committed_prompt
        progress = (committed - seen) / (now - seen_at) if now > seen_at else 0.0
        decided = at_deadline(len(f.prompt), following.order.target, committed, progress, self._rates.rates,
                              prefilling(self._requests.values()), self.config.follow_max_wait)
        f.decision.update(follow_extended=decided.keep, ttft_follow_left_s=round(decided.ttft_follow_s, 4),
                          ttft_clone_now_s=round(decided.ttft_now_s, 4))
        if not decided.keep:
            return False
        following.seen = now, committed
        following.timer = asyncio.get_running_loop().call_later(decided.recheck_s, self._follow_expired, f.rid)
        return True

    def _unpark(self, f: Request, landed: Landed | None = None, answered: bool = False) -> None:
        """Back to the queue's phase. Unless the runner `answered` its order, the order is dropped (a clone
        made meanwhile comes back to nobody and is released: its bytes stay held until then)."""
        self._followers.pop(f.rid, None)
        following = f.phase
        assert isinstance(following, Following)
        if following.timer is not None:
            following.timer.cancel()
        if following.registered and not answered:
            assert self._admission is not None
            self._admission.abandon(f, self._admission.clone_bytes(following.order.target))
            self._send(m.Cancel(f.rid))  # drops its clone order
        phase.queue(f, landed)

    def _requeue(self, r: Request) -> None:
        """Back in the queue at its arrival place, holding nothing (or only its landed session)."""
        assert self._admission is not None
        if not (isinstance(r.phase, Queued) and r.phase.landed is not None):
            self._admission.let_go(r)
        self._admission.requeue(r)

    def _leader_left(self, r: Request) -> None:
        """Requests parked on `r` whose order never reached the runner plan again from the queue."""
        orphans = [f for f in self._followers.values()
                   if isinstance(f.phase, Following) and f.phase.order.leader == r.rid and not f.phase.registered]
        for f in orphans:  # back to the queue, in arrival order: they plan again when admitted
            self._unpark(f)
            self._requeue(f)

    # ---- restoring from the disk tier ----

    def _restore(self, r: Request, match: Any) -> None:
        """Park `r`, holding the bytes of the session it will be handed and no slot, while the disk
        thread reads and checks the file; the runner then loads it."""
        adm, disk = self._admission, self._disk
        assert adm is not None and disk is not None
        adm.leave_slot(r)
        held = adm.reserve(r, adm.clone_bytes(match.upto))  # the session it will be handed, before it exists
        assert held, "a restored session costs no more than the slot it gives back"
        phase.restore(r, match)
        disk.touch(match.entry)
        self._expire_at(r, r.submitted_at + self.config.queue_timeout)
        disk.read(match.entry, lambda state, outcome, seconds: self._read(r.rid, match, state, outcome, seconds))

    def _read(self, rid: int, match: Any, state: Any, outcome: str, seconds: float) -> None:
        """The disk thread read `match`'s file (state None: it was bad, and is gone)."""
        r = self._requests.get(rid)
        if r is None or not isinstance(r.phase, Restoring) or r.phase.match is not match:
            return  # it left meanwhile
        if state is not None:
            self._rates = self._rates.observe_read(match.entry.nbytes, seconds)
            try:
                state = state.prefix(match.upto)
            except Exception as exc:  # the lookup's rules admit it; a file that disagrees is dropped, r prefills
                self._disk.forget(match.entry)  # type: ignore[union-attr]
                self._reuse_failed("disk", exc)
                state, outcome = None, "corrupt"
        if state is None:
            self.metrics.disk_restores.inc(outcome=outcome)
            r.decision["disk"] = outcome
            self._stop_restoring(r)
            self._admit()
            return
        r.phase.sent = True
        self._send(m.Restore(rid, state))

    def _stop_restoring(self, r: Request, landed: Landed | None = None) -> None:
        if landed is None:
            r.tried.no_disk = True
        phase.queue(r, landed)
        self._requeue(r)

    # ---- request ends ----

    def _cancel(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending == "cancelled":
            return
        r.ending = "cancelled"
        if self._index is not None:
            self._index.stop(rid)
        if self._with_runner(r):
            self._send(m.Cancel(rid))
        else:  # the runner holds nothing of it (a pending clone comes back to nobody and is released)
            self.complete(r, "cancelled")
            self._admit()

    def _finish(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending:
            return
        r.ending = "stop"
        if self._index is not None:
            self._index.stop(rid)
        if self._with_runner(r):
            self._send(m.Finish(rid))
        else:
            self.complete(r, "stop")

    @staticmethod
    def _with_runner(r: Request) -> bool:
        """Whether the runner has (or will have) `r`: a choice goes there only with its lead's Start."""
        return r.holds_slot and (r.lead is None or r.sent)

    def _expire(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is not None and isinstance(r.phase, phase.Waiting):
            self.complete(r, "error", f"waited longer than --queue-timeout ({self.config.queue_timeout:g} s)")
            self._admit()  # the expired head may have been all that held the queue back

    def _leave(self, r: Request) -> None:
        """Everything `r` holds on the loop goes back: its slot, bytes, capture, named session, landed clone."""
        adm = self._admission
        if adm is not None:
            if isinstance(r.phase, Following):  # first: a clone order it abandons keeps its bytes held
                self._unpark(r)
            if isinstance(r.phase, Restoring) and r.phase.sent:  # the runner may have loaded it already
                adm.abandon(r, adm.clone_bytes(r.phase.match.upto))
            self._leader_left(r)
            adm.release(r)
            if r.named is not None and r.named.busy:
                self._named.give_back(r.named)  # type: ignore[union-attr]
            if isinstance(r.phase, Queued) and r.phase.landed is not None:
                adm.release_sessions([r.phase.landed.sid])
        if self._index is not None:
            self._index.stop(r.rid)
        if r.expiry is not None:
            r.expiry.cancel()
        del self._requests[r.rid]
        if not self._requests:
            self._idle.set()

    def _withdraw(self, r: Request) -> None:
        """Turned away after all: as if it never came (no DoneEvent, nobody holds its handle yet)."""
        for x in (r, *r.siblings):
            self._leave(x)
            phase.finish(x, "cancelled")

    def complete(self, r: Request, reason: str, error: str | None = None, grammar_failed: bool = False,
                 gave_way: bool = False) -> None:
        if isinstance(r.phase, phase.Finished):
            return
        self._leave(r)
        phase.finish(r, reason, error)
        event = DoneEvent(reason, r.usage(time.monotonic()), error, grammar_failed, gave_way)  # type: ignore[arg-type]
        self.metrics.done(r, event)
        r.handle.put(event)
        for sibling in r.waiting_siblings:  # it ended before the runner had it: so do its other choices
            self.complete(sibling, reason, error, grammar_failed, gave_way)

    # ---- runner events ----

    def _drain(self) -> None:
        t0 = time.perf_counter()
        assert self._runner is not None
        events = self._runner.events
        while events:
            event = events.popleft()
            handler = self._handlers.get(type(event))
            if handler is None:
                raise TypeError(f"unknown runner event {event!r}")
            handler(self, event)
        self._admit()
        self.metrics.control_seconds.inc(time.perf_counter() - t0)

    def _on_loaded(self, ev: m.Loaded) -> None:
        self.info = ev.info
        self.config, self.memory = self.config.resolve(ev.info, ev.device)
        c = self.config
        disk = self._disk_identity(ev.info)
        # Scopes are named under the disk tier's secret, so its files keep their scope across restarts;
        # without the tier, under a key of this process's own.
        self._index = Index(ev.info, c.prefix_cache_entries, c.prefix_cache_bytes, c.prefix_cache_min_tokens,
                            disk[1] if disk else os.urandom(32))
        self._named = NamedSessions(c.max_named_sessions, self._index)
        if disk is not None:
            assert self.kv_dir is not None
            self._disk = DiskTier(self.kv_dir, disk[0], c.prefix_cache_disk_bytes, self._index)
        self._admission = Admission(c, ev.info, self._index, self._named, self._disk, self._send)
        if self.kv_events is not None:
            self.kv_events.attach(self._index, self._disk is not None and self._disk.on)
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
            fp = fingerprint(resolve_model(self.model_path), info.dtype, self.backend.state_format)
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
            self._loaded.set_exception(RuntimeError(ev.error))
        for r in list(self._requests.values()):
            self.complete(r, "error", ev.error)

    def _on_started(self, ev: m.Started) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            return
        assert self._admission is not None and self._index is not None
        p = r.phase
        assert isinstance(p, Prefilling)
        donor_upto, candidates = p.donor_upto, p.candidates
        phase.started(r, ev.reused)
        r.reused = ev.reused
        self._index.moved(r.rid, ev.reused, ())
        if donor_upto:
            self._observe_clone("donor", [], ev.reused, ev.clone_s, r, p.cached)
        # Where its session starts is known now: its reservation shrinks to what that session grows to
        # (a named session is always opened empty; a clone at `reused`).
        adm = self._admission
        start = 0 if r.named is not None else ev.reused
        adm.reserve(r, adm.request_bytes(len(r.prompt), r.max_tokens, start, len(adm.checkpoints(r.req))))
        if r.lead is not None:  # a choice's clone of its lead: the prompt is counted once, on choice 0
            r.reused = 0
            return
        r.handle.reused = r.reused  # final from here: APIs that say the usage split up front read it
        if r.named is not None:
            r.reuse_source = "session" if ev.reused else None
        elif ev.clone_index is not None:
            r.reuse_source = "cache"
            self._rates = self._rates.observe_clone(ev.reused, ev.clone_s)
            self._index.touch(candidates[ev.clone_index].entry)
        elif not ev.reused:
            r.reuse_source = None
        if r.named is None and r.reuse_source != "donor":
            self.metrics.cache_admissions.inc(outcome="hit" if ev.clone_index is not None else "miss")
        if candidates:
            self.metrics.clone("cache", ev.refused, ev.clone_index is not None)

    def _observe_clone(self, source: str, refused: list[str], upto: int, seconds: float, r: Request,
                       cached: int) -> None:
        """A donor's clone landed for `r` (`cached`: the best prefix cache match it had instead)."""
        self.metrics.clone(source, refused, True)
        self._rates = self._rates.observe_clone(upto, seconds)
        r.reuse_source = "donor"
        self.metrics.donor_saved.inc(max(0, upto - cached))

    def _on_token(self, ev: m.Token) -> None:
        r = self._requests.get(ev.rid)
        if r is None or r.ending:
            return  # asked to end: what the runner made meanwhile is dropped
        if isinstance(r.phase, Prefilling):
            phase.decode(r)
        now = time.monotonic()
        self.metrics.token(r, now)
        r.first_token_at = r.first_token_at or now
        r.last_token_at = now
        r.handle.put(TokenEvent(ev.sampled.token, ev.sampled.logprob, ev.sampled.top_logprobs))

    def _on_captured(self, ev: m.Captured) -> None:
        assert self._admission is not None
        adm = self._admission
        r = self._requests.get(ev.rid)
        if r is not None:
            adm.capture_done(r)
        if ev.sid is None:
            self.metrics.captures.inc(outcome="failed" if ev.failed else "refused")
        elif r is None or r.ending == "cancelled":  # a capture of a cancelled request is discarded
            self.metrics.captures.inc(outcome="discarded")
            adm.release_sessions([ev.sid])
        else:
            self.metrics.captures.inc(outcome="stored")
            adm.keep_snapshot(r, ev.tokens, ev.sid, ev.nbytes, r.req.scope, ev.kept)

    def _on_ended(self, ev: m.Ended) -> None:
        assert self._admission is not None and self._named is not None
        r = self._requests.get(ev.rid)
        self._admission.pooled_now(ev.pooled)  # with its reservation let go below: its blocks others read are pooled
        if r is None:
            self._admission.release_sessions([ev.sid] if ev.sid is not None else [], max(0, ev.nbytes - ev.frees))
            return
        if r.named is not None:
            self._named.release(r.named, ev.sid, ev.held, r.req.scope, ev.nbytes, ev.frees)
        r.prefilled, r.generated = ev.prefilled, ev.generated
        self.metrics.speculated(r, ev.speculated)
        self.complete(r, ev.reason, ev.error, ev.grammar_failed)

    def _on_clone_done(self, ev: m.CloneDone) -> None:
        """A follower's clone order came back, or a donor start's clone was refused."""
        assert self._admission is not None
        r = self._requests.get(ev.rid)
        # the answer to an order its request stopped waiting for (it left, or its follow timed out)
        waits = r is not None and (isinstance(r.phase, Following) or
                                   (isinstance(r.phase, Prefilling) and r.phase.donor_upto > 0))
        if self._admission.answered(ev.rid) or not waits:
            self._admission.release_sessions([ev.sid] if ev.sid is not None else [])
            return
        assert r is not None
        cached = r.phase.cached  # type: ignore[union-attr]
        if ev.sid is not None:
            self._observe_clone("donor", [], ev.upto, ev.seconds, r, cached)
        else:
            self.metrics.clone("donor", [ev.reason] if ev.reason != "leader_gone" else [], False)
        if isinstance(r.phase, Prefilling):  # its Start's donor clone was refused: the runner did not start it
            r.decision["clone_refused"] = ev.reason
            for sibling in r.siblings:  # the runner dropped the choices that Start carried: they go with the next
                sibling.sent = False
            if r.ending:  # asked to end meanwhile: the runner holds nothing of it
                self.complete(r, r.ending)
            else:
                self._start(r, cached, candidates=self._cached_matches(r))
            return
        landed = Landed(ev.sid, ev.upto) if ev.sid is not None else None  # its hold covers it
        if landed is None and ev.reason != "leader_gone":
            r.decision["clone_refused"] = ev.reason
            r.tried.no_follow = True  # clone-now from here on
        self._unpark(r, landed, answered=True)
        self._requeue(r)

    def _on_exported(self, ev: m.Exported) -> None:
        """A spilled entry's state is on the host: to its file; its bytes go back once written."""
        adm = self._admission
        assert adm is not None
        tokens, scope, nbytes = ev.key

        def written(_: bool) -> None:
            adm.spilled(nbytes)
            self._admit()

        if ev.state is None or self._disk is None:
            written(False)
        else:
            self._disk.write(ev.state, tokens, scope, written)

    def _on_restored(self, ev: m.Restored) -> None:
        """The runner loaded a request's state (or failed to): it waits for a slot, or prefills."""
        assert self._admission is not None
        r = self._requests.get(ev.rid)
        # the answer to a load its request stopped waiting for
        if self._admission.answered(ev.rid) or r is None or not isinstance(r.phase, Restoring):
            self._admission.release_sessions([ev.sid] if ev.sid is not None else [])
            return
        outcome = "restored" if ev.sid is not None else "failed"
        self.metrics.disk_restores.inc(outcome=outcome)
        if ev.sid is None:  # loading it raised: never served again
            self._disk.forget(r.phase.match.entry)  # type: ignore[union-attr]
            self.metrics.reuse_errors.inc(stage="disk")  # the runner logged why
            r.decision["disk"] = outcome
            self._stop_restoring(r)
            return
        r.reuse_source = "disk"
        self._stop_restoring(r, Landed(ev.sid, ev.upto))  # its hold covers it

    def _on_holding(self, ev: m.Holding) -> None:
        assert self._admission is not None
        stats = self.stats
        stats.live_sessions, stats.total_bytes, stats.blocks = ev.live_sessions, ev.total_bytes, ev.blocks
        self._admission.pooled_now(ev.pooled)
        self.metrics.holding(ev.total_bytes, self.config.kv_budget_bytes)

    def _on_step_stats(self, ev: m.StepStats) -> None:
        assert self._admission is not None and self._index is not None
        self.stats = ev
        self._admission.pooled_now(ev.pooled)
        self.metrics.step(ev)
        self.metrics.holding(ev.total_bytes, self.config.kv_budget_bytes)
        self._rates = self._rates.observe_prefill(ev.prefill_tokens, ev.prefill_s)
        for rid, position in ev.committed.items():
            r = self._requests.get(rid)
            if r is not None and isinstance(r.phase, (Prefilling, Decoding)):
                r.phase.committed, r.phase.kept = position, ev.kept.get(rid, ())
                self._index.moved(rid, position, r.phase.kept)

    _handlers: dict[type, Callable[["Engine", Any], None]] = {
        m.Loaded: _on_loaded, m.Died: _on_died, m.Started: _on_started, m.Token: _on_token,
        m.Captured: _on_captured, m.Ended: _on_ended, m.CloneDone: _on_clone_done, m.Exported: _on_exported,
        m.Restored: _on_restored, m.Holding: _on_holding, m.StepStats: _on_step_stats,
    }
