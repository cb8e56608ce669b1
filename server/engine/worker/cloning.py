"""The clones the runner thread takes of its running requests' sessions: a follower's, a capture's
and a choice's.

A part of `Runner` (runner.py) that owns the followers' clone orders (clone_orders.py), built once the model is
loaded with what else it reads and writes: the backend, its executor and `run` (a session op that goes into the next
plan), the running and paused requests (read), the events for the loop, the model, and the runner's `open` and
`sample` (a choice's clone starts and samples its first token). Its surface: `clone` (every clone is one Clone op),
`clone_of`, `clone_donor`, `serve_orders`, `hand_over`, `capture`, `open_choice`, and the orders' `prefill_cap`,
`drop_recipient`, `drop_all`.

Design rules:
- a follower's clone order is served the moment its donor has committed the target (the donor's
  chunk stops there), before the donor writes again;
- a donor that leaves hands what it committed to the follower that salvages most (follow.promote),
  cloned before its state is released;
- a donor with recurrent layers holds a state only at its position and its checkpoints (the
  recurrent rule): a clone asked of it where it holds none (it moved on since the loop looked, or
  it leaves below a follower's target) is served from the highest state it holds below, if any;
- every CloneDonor is answered by exactly one CloneDone (a session, a refusal, or "cancelled" for
  an order dropped while it waited): the control loop holds the clone's bytes until then;
- a capture (a clone at prompt length) takes the request's recurrent checkpoints with it (they
  serve the same prefixes from the cache, which counts their bytes from then on). It runs right
  after the last prefill chunk and before the first decode writes: a decode would overwrite what a
  sliding layer's snapshot needs. On a model with recurrent layers it runs one token before the
  prompt's end (prefill stops there: the recurrent rule, backends.base.clone_positions), so the
  same prompt sent again, whose match is at most len - 1, is served;
- n choices prefill their prompt once: when its last logits row is in (after the capture, before
  any decode writes), each other choice gets a clone of the session at the prompt's full length and
  samples its first token from that row with its own stream (and its own matcher, at the grammar's
  start); a clone or a sample that fails fails its choice alone.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import replace
from typing import Any, Callable

from kvfork.backends import effects as e
from kvfork.backends.base import Backend, CloneRefused, ModelInfo, clone_positions
from kvfork.server.engine import messages as m
from kvfork.server.engine.worker.clone_orders import CloneOrders
from kvfork.server.engine.worker.sequence import Seq

log = logging.getLogger("kvfork.engine")


class Cloning:
    def __init__(self, backend: Backend, ex: e.Executor, run: Callable[[e.Op], Any], running: dict[int, Seq],
                 paused: dict[int, Seq], events: collections.deque, info: ModelInfo,
                 open: Callable[[m.Start, int, list[m.Choice], bool], Seq],
                 sample: Callable[[Any, dict[int, Seq]], None]):
        """`running`, `paused`: the runner's requests by id (read, never changed here)."""
        self._backend, self._ex, self._run, self._running, self._paused = backend, ex, run, running, paused
        self._events, self._info, self._open, self._sample = events, info, open, sample
        self._orders = CloneOrders()

    def clone(self, source: int, upto: int) -> int:
        """A new session holding [0, upto) of session `source` (raises CloneRefused and the rest)."""
        sid = self._ex.new_sid()
        self._run(e.Clone(sid, source, upto))
        return sid

    def prefill_cap(self, rid: int, position: int, left: int) -> int | None:
        """Where `rid`'s next prefill chunk must stop for a clone order on it to be served (clone_orders.py)."""
        return self._orders.prefill_cap(rid, position, left)

    def drop_recipient(self, rid: int) -> bool:
        """Drop the clone order `rid` waits for, if any (the caller answers it)."""
        return self._orders.drop_recipient(rid)

    def drop_all(self) -> None:
        """The runner stops: nobody is left to hand anything over to."""
        self._orders = CloneOrders()

    def clone_donor(self, command: m.CloneDonor) -> None:
        donor = self._running.get(command.donor) or self._paused.get(command.donor)
        if donor is None:
            self._events.append(m.CloneDone(command.rid, None, reason="donor_gone"))
        elif donor.session.position < command.upto:
            self._orders.add(command)
        else:
            self._clone_for(command.rid, donor, command.upto)

    def clone_of(self, donor_rid: int, upto: int) -> tuple[int, int, None] | tuple[None, int, str]:
        """`[0, upto)` of a running request's session (at most: a recurrent donor gives the highest
        state it holds at or below), with what it holds, or why not (a clone fails soft)."""
        donor = self._running.get(donor_rid) or self._paused.get(donor_rid)
        if donor is None:
            return None, 0, "donor_gone"
        if self._info.recurrent:
            held = clone_positions(donor.session.position, self._info, donor.session.kept)
            upto = max((q for q in held if q <= upto), default=upto)  # none below: the clone is refused
        try:
            return self.clone(donor.sid, upto), upto, None
        except CloneRefused as refusal:
            return None, 0, refusal.reason
        except Exception as exc:
            log.warning("clone of request %d failed: %s", donor_rid, exc)
            return None, 0, "error"

    def _clone_for(self, rid: int, donor: Seq, upto: int, refused_reason: str | None = None) -> None:
        t0 = time.perf_counter()
        sid, upto, reason = self.clone_of(donor.rid, upto)
        if sid is not None:
            self._events.append(m.CloneDone(rid, sid, upto, seconds=time.perf_counter() - t0))
        else:
            self._events.append(m.CloneDone(rid, None, reason=refused_reason or reason))

    def serve_orders(self) -> None:
        for order in self._orders.due({rid: s.session.position for rid, s in self._running.items()}):
            self._clone_for(order.rid, self._running[order.donor], order.upto)

    def hand_over(self, s: Seq, usable: bool) -> None:
        """A donor with followers waiting is leaving: its heir gets what it committed, the rest plan again."""
        committed = min(s.session.position, len(s.start.prompt))
        heir, upto, others = self._orders.leaving(s.rid, committed, usable)
        if heir is not None:
            self._clone_for(heir.rid, s, upto, refused_reason="leader_gone")
        for order in others:
            self._events.append(m.CloneDone(order.rid, None, reason="leader_gone"))

    def capture(self, s: Seq) -> None:
        prompt = s.start.prompt[:s.capture_at]
        try:
            snapshot = self.clone(s.sid, len(prompt))
        except CloneRefused as refusal:
            log.info("capture of request %d refused: %s", s.rid, refusal)
            self._events.append(m.Captured(s.rid, prompt, None))
            return
        except Exception as exc:  # optional work: the request goes on without a snapshot
            log.warning("capture of request %d failed: %r", s.rid, exc)
            self._events.append(m.Captured(s.rid, prompt, None, failed=True))
            return
        if s.session.kept:  # its message-boundary checkpoints go with the snapshot, which serves them
            try:
                self._run(e.MoveCheckpoints(s.sid, snapshot))
            except Exception as exc:  # optional work: the snapshot serves its own length only
                log.warning("moving checkpoints of request %d to its snapshot failed: %r", s.rid, exc)
        session = self._ex.sessions[snapshot]
        self._events.append(m.Captured(s.rid, prompt, snapshot, self._backend.session_bytes(session),
                                      kept=session.kept))

    def open_choice(self, lead: Seq, rid: int, logits: Any, row: int) -> None:
        """`lead`'s prompt is in and row `row` of `logits` is its last: choice `rid` starts from a clone at
        the prompt's full length (before `lead` decodes) and samples its first token from that row."""
        choice = next(c for c in lead.choices if c.rid == rid)
        lead.choices.remove(choice)
        start = replace(lead.start, rid=rid, sampling=choice.sampling, capture=False, choices=[])
        try:
            sid = self.clone(lead.sid, len(start.prompt))
        except Exception as exc:  # the clone of one choice fails that choice alone
            log.warning("the clone for choice request %d failed: %r", rid, exc)
            self._events.append(m.Ended(rid, "error", 0, 0, error=f"its clone failed: {exc!r}"))
            return
        s = self._open(start, sid, [], True)
        self._events.append(m.Started(rid, len(start.prompt), None))
        self._sample(logits, {row: s})
