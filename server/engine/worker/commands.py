"""The control loop's commands, as the runner thread runs them: a request's Start (a clone from the
prefix cache, a session resumed, or an empty one), its Cancel or Finish, its Pause and Unpause (out of the
batch and back, everything it holds kept), and the sessions the loop lets go (ReleaseSessions), spills to disk
(Spill) and loads back (LoadState).

A part of `Runner` (runner.py), built once the model is loaded with what it reads and writes: the inbox, the events
for the loop and `notify`, the backend, its executor and `run` (a session op that goes into the next plan), the
running and paused requests (a Pause moves one across), the grammar rows, Cloning (every clone), and the runner's
`open` and `end` (a request takes its slot, and leaves it). Its surface: `take_commands`, `keep_at`, and what it
counted: `releases`, `stopping`.

Design rules:
- commands run in the order the loop sent them, at the top of a step, before it is planned;
- a clone from the prefix cache, a spill's export, a state's load and checkpoints at message
  boundaries are optional work: one that fails falls back (to the next candidate, an empty
  session, a prefill) and is counted, never failing its request;
- a Cancel or Finish drops a clone order its request waits for, and answers it (cloning.py).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

from kvfork.backends import effects as e
from kvfork.backends.base import Backend, CloneRefused
from kvfork.server.engine import messages as m
from kvfork.server.engine.worker.cloning import Cloning
from kvfork.server.engine.worker.constraints import ConstrainedRows
from kvfork.server.engine.worker.sequence import Seq

log = logging.getLogger("kvfork.engine")


class Commands:
    def __init__(self, inbox: collections.deque, events: collections.deque, notify: Callable[[], None],
                 backend: Backend, ex: e.Executor, run: Callable[[e.Op], Any], running: dict[int, Seq],
                 paused: dict[int, Seq], rows: ConstrainedRows, cloning: Cloning,
                 open: Callable[[m.Start, int, list[m.Choice]], Seq], end: Callable[[Seq, str], None]):
        """`open`, `end`: the runner's, a request taking its slot and leaving it."""
        self._inbox, self._events, self._notify, self._backend, self._ex = inbox, events, notify, backend, ex
        self._run, self._running, self._paused, self._rows = run, running, paused, rows
        self._cloning, self._open, self._end = cloning, open, end
        self.releases = 0  # ReleaseSessions commands run (m.Ledger.releases)
        self.stopping = False  # a StopRunner ran: the thread stops

    def take_commands(self) -> bool:
        """Run what the loop sent, in order; whether there was anything."""
        took = bool(self._inbox)
        while self._inbox:
            match self._inbox.popleft():
                case m.Start() as start:
                    self._start(start)
                case m.Cancel(rid=rid):
                    self._stop(rid, "cancelled")
                case m.Finish(rid=rid):
                    self._stop(rid, "stop")
                case m.Pause(rid=rid) if rid in self._running:  # one that ended meanwhile is not paused
                    self._paused[rid] = self._running.pop(rid)
                case m.Unpause(rid=rid) if rid in self._paused:
                    self._running[rid] = self._paused.pop(rid)
                case m.CloneDonor() as order:
                    self._cloning.clone_donor(order)
                case m.ReleaseSessions(sids=sids):
                    self._run(e.Release(sids))
                    self.releases += 1
                case m.Spill() as spill:
                    self._spill(spill)
                case m.LoadState() as load:
                    self._load_state(load)
                case m.StopRunner():
                    self._cloning.drop_all()
                    for s in [*self._running.values(), *self._paused.values()]:
                        self._end(s, "cancelled")
                    self._rows.close()
                    self.stopping = True
        self._cloning.serve_orders()
        if self._events:
            self._notify()
        return took

    def _start(self, start: m.Start) -> None:
        sid, reused, index, refused, clone_s = start.resume, start.resume_at, None, [], 0.0
        if start.donor is not None:
            t0 = time.perf_counter()
            sid, reused, reason = self._cloning.clone_of(*start.donor)
            if sid is None:
                assert reason is not None  # clone_of says why when it gives no session
                self._events.append(m.CloneDone(start.rid, None, reason=reason))
                return
            clone_s = time.perf_counter() - t0
        try:
            for i, (source, upto) in enumerate(start.clone_from if sid is None else ()):
                try:
                    t0 = time.perf_counter()
                    sid, reused, index = self._cloning.clone(source, upto), upto, i
                    clone_s = time.perf_counter() - t0
                    break
                except CloneRefused as refusal:
                    refused.append(refusal.reason)
                except Exception as exc:  # optional work: the next candidate, or a cold start
                    log.warning("clone from the prefix cache for request %d failed: %r", start.rid, exc)
                    refused.append("error")
            if sid is None:
                sid, reused = self._ex.new_sid(), 0
                self._run(e.Open(sid))
            if start.keep_at:
                self.keep_at(sid, start.keep_at)
            images, encoded = self._encode(start, sid, reused)
        except Exception as exc:
            log.exception("start failed")
            self._events.append(m.Started(start.rid, 0, None, refused))
            for rid in [start.rid] + [choice.rid for choice in start.choices]:
                self._events.append(m.Ended(rid, "error", 0, 0, error=f"start failed: {exc}"))
            return
        self._open(start, sid, list(start.choices)).images = tuple(image.image for image in images)
        self._events.append(m.Started(start.rid, reused, index, refused, clone_s, encoded))

    def _encode(self, start: m.Start, sid: int, reused: int) -> tuple[tuple, int]:
        """The images its prefill reads (past `reused`), held by the backend for it, and how many were encoded
        (the others were cached); a failure releases its session and fails its start."""
        images = tuple(image for image in start.images if image.end > reused)
        if not images:
            return images, 0
        try:
            return images, self._backend.encode_images(images, start.scope)
        except BaseException:
            self._run(e.Release([sid]))
            raise

    def _stop(self, rid: int, reason: str) -> None:
        """Cancel or Finish: the request leaves (a clone order it waits for is dropped, and answered)."""
        if self._cloning.drop_recipient(rid):  # every order is answered, a dropped one too
            self._events.append(m.CloneDone(rid, None, reason="cancelled"))
        s = self._running.get(rid) or self._paused.get(rid)
        if s is not None:
            self._end(s, reason)
        else:
            self._drop_choice(rid, reason)

    def _spill(self, command: m.Spill) -> None:
        """Optional work: a state that fails to export is simply not kept on disk."""
        state = None
        try:
            state = self._run(e.Export(command.sid))
        except Exception as exc:
            log.warning("exporting a prefix cache entry failed: %r", exc)
        self._run(e.Release([command.sid]))
        self._events.append(m.Exported(command.key, state))

    def _load_state(self, command: m.LoadState) -> None:
        """Optional work: a state that fails to load leaves its request to prefill."""
        t0, sid = time.perf_counter(), self._ex.new_sid()
        try:
            self._run(e.Import(sid, command.state))
        except Exception as exc:
            log.warning("loading a saved state for request %d failed: %r", command.rid, exc)
            self._events.append(m.StateLoaded(command.rid, None))
            return
        self._events.append(m.StateLoaded(command.rid, sid, self._ex.sessions[sid].position, time.perf_counter() - t0))

    def keep_at(self, sid: int, positions: tuple[int, ...]) -> None:
        """Checkpoints at message boundaries are optional work: a backend that fails them runs on without."""
        try:
            self._run(e.KeepAt(sid, tuple(positions)))
        except Exception as exc:
            log.warning("keeping checkpoints at %s failed: %r", positions, exc)

    def _drop_choice(self, rid: int, reason: str) -> None:
        """A choice still waiting for its prompt leaves alone."""
        for s in self._running.values():
            if any(choice.rid == rid for choice in s.choices):
                s.choices = [choice for choice in s.choices if choice.rid != rid]
                self._events.append(m.Ended(rid, reason, 0, 0))
                return
