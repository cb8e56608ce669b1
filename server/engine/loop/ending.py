"""The last phase, Finished: a request asked to end (cancelled, a stop string, its queue timeout) or
ended by the runner, and everything it held going back.

A part of `Serving` (serving.py), built with what it reads and writes: the request table (a request leaves it
here), the managers that take back what a request held (Admission, Index, NamedSessions, Parking), the runner's
queue (`send`), the metrics, Progress (the ledger an end carries), `admit` to call once a slot is free, and the
state machine's `idle` event, set once the table is empty. Its surface: `cancel`, `finish`, `expire`, `withdraw`,
`complete`, and the runner's `on_ended`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from kvfork.server.engine import messages as m
from kvfork.server.engine.api import DoneEvent
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.cache.sessions import NamedSessions
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop import request as phase
from kvfork.server.engine.loop.admission import Admission
from kvfork.server.engine.loop.parking import Parking
from kvfork.server.engine.loop.progress import Progress
from kvfork.server.engine.loop.request import Following, Queued, Request, Restoring
from kvfork.server.engine.loop.telemetry import EngineMetrics


class Ending:
    def __init__(self, requests: dict[int, Request], admission: Admission, index: Index, named: NamedSessions,
                 parking: Parking, progress: Progress, send: Callable[[Any], None], config: EngineConfig,
                 metrics: EngineMetrics, admit: Callable[[], None], idle: asyncio.Event):
        """`requests`: the state machine's table of requests, by id; a request that ends leaves it here."""
        self._requests, self._admission, self._index, self._named = requests, admission, index, named
        self._parking, self._progress, self._send, self._config = parking, progress, send, config
        self._metrics, self._admit, self._idle = metrics, admit, idle

    def cancel(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending == "cancelled":
            return
        r.ending = "cancelled"
        self._index.stop(rid)
        if self._with_runner(r):
            self._send(m.Cancel(rid))
        else:  # the runner holds nothing of it (a pending clone comes back to nobody and is released)
            self.complete(r, "cancelled")
            self._admit()

    def finish(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is None or r.ending:
            return
        r.ending = "stop"
        self._index.stop(rid)
        if self._with_runner(r):
            self._send(m.Finish(rid))
        else:
            self.complete(r, "stop")

    @staticmethod
    def _with_runner(r: Request) -> bool:
        """Whether the runner has (or will have) `r`: a choice goes there only with its parent's Start."""
        return isinstance(r.phase, phase.WithRunner) and (r.parent is None or r.sent)

    def expire(self, rid: int) -> None:
        r = self._requests.get(rid)
        if r is not None and isinstance(r.phase, phase.Waiting):
            self.complete(r, "error", f"waited longer than --queue-timeout ({self._config.queue_timeout:g} s)")
            self._admit()  # the expired head may have been all that held the queue back

    def _leave(self, r: Request) -> None:
        """Everything `r` holds on the loop goes back: its slot, bytes, capture, named session, landed clone."""
        adm = self._admission
        if isinstance(r.phase, Following):  # first: a clone order it abandons keeps its bytes held
            self._parking.unpark(r)
        if isinstance(r.phase, Restoring) and r.phase.sent:  # the runner may have loaded it already
            self._parking.abandon(r, adm.clone_bytes(r.phase.match.upto))
        self._parking.leader_left(r)
        adm.release(r)
        if r.named is not None and r.named.busy:
            self._named.give_back(r.named)
        if isinstance(r.phase, Queued) and r.phase.landed is not None:
            adm.release_sessions([r.phase.landed.sid])
        self._index.stop(r.rid)
        if r.expiry is not None:
            r.expiry.cancel()
        del self._requests[r.rid]
        if not self._requests:
            self._idle.set()

    def withdraw(self, r: Request) -> None:
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
        self._metrics.done(r, event)
        r.handle.put(event)
        for sibling in r.waiting_siblings:  # it ended before the runner had it: so do its other choices
            self.complete(sibling, reason, error, grammar_failed, gave_way)

    def on_ended(self, ev: m.Ended) -> None:
        r = self._requests.get(ev.rid)
        if ev.ledger is not None:  # with its reservation let go below: its blocks others read are pooled
            self._progress.on_ledger(ev.ledger)
        if r is None:
            self._admission.release_sessions([ev.sid] if ev.sid is not None else [], max(0, ev.nbytes - ev.frees))
            return
        if r.named is not None:
            self._named.release(r.named, ev.sid, ev.held, r.req.scope, ev.nbytes, ev.frees)
        r.prefilled, r.generated = ev.prefilled, ev.generated
        self._metrics.speculated(r, ev.speculated)
        self.complete(r, ev.reason, ev.error, ev.grammar_failed)

