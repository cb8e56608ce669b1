"""The clones the runner thread takes of its running requests' sessions: a follower's, a capture's
and a choice's.

A part of `Runner` (runner.py), whose state it reads: the running requests, the clone orders.

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

import logging
import time
from dataclasses import replace
from typing import Any

from kvfork.backends import effects as e
from kvfork.backends.base import CloneRefused, clone_positions
from kvfork.server.engine import messages as m
from kvfork.server.engine.sequence import Seq

log = logging.getLogger("kvfork.engine")


class Cloning:
    def _clone_donor(self, command: m.CloneDonor) -> None:
        donor = self._running.get(command.donor) or self._paused.get(command.donor)
        if donor is None:
            self.events.append(m.CloneDone(command.rid, None, reason="donor_gone"))
        elif donor.session.position < command.upto:
            self._orders.add(command)
        else:
            self._clone_for(command.rid, donor, command.upto)

    def _clone_of(self, donor_rid: int, upto: int) -> tuple[int, int, None] | tuple[None, int, str]:
        """`[0, upto)` of a running request's session (at most: a recurrent donor gives the highest
        state it holds at or below), with what it holds, or why not (a clone fails soft)."""
        donor = self._running.get(donor_rid) or self._paused.get(donor_rid)
        if donor is None:
            return None, 0, "donor_gone"
        if self._info is not None and self._info.recurrent:
            held = clone_positions(donor.session.position, self._info, donor.session.kept)
            upto = max((q for q in held if q <= upto), default=upto)  # none below: the clone is refused
        try:
            return self._clone(donor.sid, upto), upto, None
        except CloneRefused as refusal:
            return None, 0, refusal.reason
        except Exception as exc:
            log.warning("clone of request %d failed: %s", donor_rid, exc)
            return None, 0, "error"

    def _clone_for(self, rid: int, donor: Seq, upto: int, refused_reason: str | None = None) -> None:
        t0 = time.perf_counter()
        sid, upto, reason = self._clone_of(donor.rid, upto)
        if sid is not None:
            self.events.append(m.CloneDone(rid, sid, upto, seconds=time.perf_counter() - t0))
        else:
            self.events.append(m.CloneDone(rid, None, reason=refused_reason or reason))

    def _serve_orders(self) -> None:
        for order in self._orders.due({rid: s.session.position for rid, s in self._running.items()}):
            self._clone_for(order.rid, self._running[order.donor], order.upto)

    def _hand_over(self, s: Seq, usable: bool) -> None:
        """A donor with followers waiting is leaving: its heir gets what it committed, the rest plan again."""
        committed = min(s.session.position, len(s.start.prompt))
        heir, upto, others = self._orders.leaving(s.rid, committed, usable)
        if heir is not None:
            self._clone_for(heir.rid, s, upto, refused_reason="leader_gone")
        for order in others:
            self.events.append(m.CloneDone(order.rid, None, reason="leader_gone"))

    def _capture(self, s: Seq) -> None:
        prompt = s.start.prompt[:s.capture_at]
        try:
            snapshot = self._clone(s.sid, len(prompt))
        except CloneRefused as refusal:
            log.info("capture of request %d refused: %s", s.rid, refusal)
            self.events.append(m.Captured(s.rid, prompt, None))
            return
        except Exception as exc:  # optional work: the request goes on without a snapshot
            log.warning("capture of request %d failed: %r", s.rid, exc)
            self.events.append(m.Captured(s.rid, prompt, None, failed=True))
            return
        if s.session.kept:  # its message-boundary checkpoints go with the snapshot, which serves them
            try:
                self._run(e.MoveCheckpoints(s.sid, snapshot))
            except Exception as exc:  # optional work: the snapshot serves its own length only
                log.warning("moving checkpoints of request %d to its snapshot failed: %r", s.rid, exc)
        session = self._ex.sessions[snapshot]
        self.events.append(m.Captured(s.rid, prompt, snapshot, self.backend.session_bytes(session),
                                      kept=session.kept))

    def _open_choice(self, lead: Seq, rid: int, logits: Any, row: int) -> None:
        """`lead`'s prompt is in and row `row` of `logits` is its last: choice `rid` starts from a clone at
        the prompt's full length (before `lead` decodes) and samples its first token from that row."""
        choice = next(c for c in lead.choices if c.rid == rid)
        lead.choices.remove(choice)
        start = replace(lead.start, rid=rid, sampling=choice.sampling, capture=False, choices=[])
        try:
            sid = self._clone(lead.sid, len(start.prompt))
        except Exception as exc:  # the clone of one choice fails that choice alone
            log.warning("the clone for choice request %d failed: %r", rid, exc)
            self.events.append(m.Ended(rid, "error", 0, 0, error=f"its clone failed: {exc!r}"))
            return
        s = self._open(start, sid, [], planned=True)
        self.events.append(m.Started(rid, len(start.prompt), None))
        self.sample(logits, {row: s})
