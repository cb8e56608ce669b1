"""The control loop's commands, as the runner thread runs them: a request's Start (a clone from the
prefix cache, a session resumed, or an empty one), its Cancel or Finish, its Pause and Unpause (out of the
batch and back, everything it holds kept), and the sessions the loop lets go (ReleaseSessions), spills to disk
(Spill) and loads back (LoadState).

A part of `Runner` (runner.py), whose state it reads: the inbox, the running requests, the executor.

Design rules:
- commands run in the order the loop sent them, at the top of a step, before it is planned;
- a clone from the prefix cache, a spill's export, a state's load and checkpoints at message
  boundaries are optional work: one that fails falls back (to the next candidate, an empty
  session, a prefill) and is counted, never failing its request;
- a Cancel or Finish drops a clone order its request waits for, and answers it (cloning.py).
"""

from __future__ import annotations

import logging
import time

from kvfork.backends import effects as e
from kvfork.backends.base import CloneRefused, SamplerState
from kvfork.server.engine import messages as m
from kvfork.server.engine import plan as p
from kvfork.server.engine.clone_orders import CloneOrders
from kvfork.server.engine.sequence import Seq

log = logging.getLogger("kvfork.engine")


class Commands:
    def take_commands(self) -> bool:
        """Run what the loop sent, in order; whether there was anything."""
        took = bool(self.inbox)
        while self.inbox:
            match self.inbox.popleft():
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
                    self._clone_donor(order)
                case m.ReleaseSessions(sids=sids):
                    self._run(e.Release(sids))
                    self._releases += 1
                case m.Spill() as spill:
                    self._spill(spill)
                case m.LoadState() as load:
                    self._load_state(load)
                case m.StopRunner():
                    self._orders = CloneOrders()  # nobody is left to hand anything over to
                    for s in [*self._running.values(), *self._paused.values()]:
                        self._end(s, "cancelled")
                    self._rows.close()
                    self._stopping = True
        self._serve_orders()
        if self.events:
            self._notify()
        return took

    def _start(self, start: m.Start) -> None:
        sid, reused, index, refused, clone_s = start.resume, start.resume_at, None, [], 0.0
        if start.donor is not None:
            t0 = time.perf_counter()
            sid, reused, reason = self._clone_of(*start.donor)
            if sid is None:
                self.events.append(m.CloneDone(start.rid, None, reason=reason))
                return
            clone_s = time.perf_counter() - t0
        try:
            for i, (source, upto) in enumerate(start.clone_from if sid is None else ()):
                try:
                    t0 = time.perf_counter()
                    sid, reused, index = self._clone(source, upto), upto, i
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
                self._keep_at(sid, start.keep_at)
        except Exception as exc:
            log.exception("start failed")
            self.events.append(m.Started(start.rid, 0, None, refused))
            for rid in [start.rid] + [choice.rid for choice in start.choices]:
                self.events.append(m.Ended(rid, "error", 0, 0, error=f"start failed: {exc}"))
            return
        self._open(start, sid, list(start.choices))
        self.events.append(m.Started(start.rid, reused, index, refused, clone_s))

    def _open(self, start: m.Start, sid: int, choices: list[m.Choice], planned: bool = False) -> Seq:
        """`start`'s request takes its slot on session `sid`, with its sampler and its grammar's matcher
        (`planned`: the plan named its sampler already)."""
        capture_at = len(start.prompt) - 1 if self._info is not None and self._info.recurrent else len(start.prompt)
        s = self._running[start.rid] = Seq(start, sid, self._ex.sessions[sid],
                                           SamplerState(start.sampling, prompt=start.prompt), choices=choices,
                                           capture_at=capture_at if start.capture else 0)
        if not planned:
            self._opened.append(p.Sampler(start.rid, start.sampling, start.prompt))
        self._rows.start(start.rid, start.constraint)
        if self._draft_cap and self._drafts is not None:
            try:
                s.drafts = self._drafts.open(start.scope, start.prompt)
            except Exception as exc:  # optional work: it decodes without
                log.warning("opening a drafter for request %d failed: %r", start.rid, exc)
        return s

    def _clone(self, source: int, upto: int) -> int:
        """A new session holding [0, upto) of session `source` (raises CloneRefused and the rest)."""
        sid = self._ex.new_sid()
        self._run(e.Clone(sid, source, upto))
        return sid

    def _stop(self, rid: int, reason: str) -> None:
        """Cancel or Finish: the request leaves (a clone order it waits for is dropped, and answered)."""
        if self._orders.drop_recipient(rid):  # every order is answered, a dropped one too
            self.events.append(m.CloneDone(rid, None, reason="cancelled"))
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
        self.events.append(m.Exported(command.key, state))

    def _load_state(self, command: m.LoadState) -> None:
        """Optional work: a state that fails to load leaves its request to prefill."""
        t0, sid = time.perf_counter(), self._ex.new_sid()
        try:
            self._run(e.Import(sid, command.state))
        except Exception as exc:
            log.warning("loading a saved state for request %d failed: %r", command.rid, exc)
            self.events.append(m.StateLoaded(command.rid, None))
            return
        self.events.append(m.StateLoaded(command.rid, sid, self._ex.sessions[sid].position, time.perf_counter() - t0))

    def _keep_at(self, sid: int, positions: tuple[int, ...]) -> None:
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
                self.events.append(m.Ended(rid, reason, 0, 0))
                return
