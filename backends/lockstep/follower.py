"""A rank other than 0: it runs no engine and decides nothing. It applies rank 0's plans to its own
shard of the model, effect by effect, until rank 0 says stop or can no longer be reached.

Every effect here succeeded on rank 0 already (leader.py records only what did), so it succeeds
here too: the ranks hold the same sessions at the same positions, each its own shard. One that
fails here anyway (memory, a lost peer) leaves this rank's state apart from rank 0's, and no rank
may run a plan alone: the rank leaves, and rank 0 finds it gone at its next collective.
"""

from __future__ import annotations

import logging
from typing import Any

from backends.base import Backend, Session
from backends.lockstep import plan as p
from backends.lockstep import saved
from backends.lockstep.channel import Channel
from backends.lockstep.loading import load_in_step

log = logging.getLogger("kvfork.lockstep")


class Follower:
    """The sessions of one follower rank, by wire id, and the verbs that apply rank 0's effects to them."""

    def __init__(self, backend: Backend, channel: Channel):
        self.backend, self.channel = backend, channel
        self.sessions: dict[int, Session] = {}
        self.steps = 0
        self.open_at_stop = 0

    def run(self) -> str:
        """Apply plans until a Stop; returns its reason. Raises when the plan stream breaks."""
        while True:
            plan = p.decode(self.channel.broadcast(None))
            self.steps += 1
            if plan.step != self.steps:
                raise RuntimeError(f"plan {plan.step} arrived when {self.steps} was due")
            for effect in plan.effects:
                if isinstance(effect, p.Stop):
                    self.open_at_stop = len(self.sessions)  # rank 0 holds as many (it releases them too)
                    self.release_all()
                    return effect.reason
                self.apply(effect)

    def apply(self, effect: Any) -> None:
        b, s = self.backend, self.sessions
        match effect:
            case p.Load(folder, dtype, clone_mode):
                b.set_clone_mode(clone_mode)  # type: ignore[arg-type]
                load_in_step(b, self.channel, folder, dtype)
            case p.Open(sid):
                s[sid] = b.open_session()
            case p.Clone(sid, source, upto):
                s[sid] = b.clone(s[source], upto)
            case p.Prefill(sids, chunks):
                b.prefill([s[i] for i in sids], chunks)
            case p.Decode(sids, tokens):
                b.decode([s[i] for i in sids], tokens)
            case p.Release(sids):
                for sid in sids:
                    b.release(s.pop(sid))
            case p.KeepAt(sid, positions):
                b.keep_at(s[sid], positions)
            case p.MoveCheckpoints(source, target):
                b.move_checkpoints(s[source], s[target])
            case p.Export(sid):
                self.export(s[sid])
            case p.Import():
                self.import_state(effect)
            case other:
                raise TypeError(f"unknown plan effect {other!r}")

    def export(self, session: Session) -> None:
        try:
            shard = self.backend.export_state(session)
        except Exception as exc:  # optional work: every rank learns it failed and drops it
            log.warning("exporting a state failed: %r", exc)
            self.channel.all_ok(False)
            return
        if self.channel.all_ok(True):
            self.channel.gather(saved.to_bytes(shard))

    def import_state(self, effect: p.Import) -> None:
        buffer = self.channel.broadcast_buffer(None, saved.nbytes(effect.layers))
        whole = saved.from_bytes(effect.position, effect.layers, buffer)
        session = None
        try:
            session = self.backend.import_state(saved.shard(whole, self.channel.rank, self.channel.size))
        except Exception as exc:
            log.warning("loading a state failed: %r", exc)
        if self.channel.all_ok(session is not None):
            assert session is not None
            self.sessions[effect.sid] = session
        elif session is not None:
            self.backend.release(session)

    def release_all(self) -> None:
        for session in self.sessions.values():
            self.backend.release(session)
        self.sessions.clear()
