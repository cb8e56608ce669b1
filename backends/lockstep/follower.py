"""A rank other than 0: it runs no engine and decides nothing. It runs rank 0's effects on its own
shard of the model, through its own Executor (backends/effects.py), until rank 0 says stop or can no
longer be reached.

Every effect here succeeded on rank 0 already (leader.py records only what did), so it succeeds
here too: the ranks hold the same sessions at the same positions, each its own shard. One that
fails here anyway (memory, a lost peer) leaves this rank's state apart from rank 0's, and no rank
may run an effect alone: the rank leaves, and rank 0 finds it gone at its next collective. Exports
and imports are optional work: one that fails on any rank is dropped on every rank.
"""

from __future__ import annotations

import logging

from kvfork.backends import effects as e
from kvfork.backends.base import Backend, KVStorage
from kvfork.backends.lockstep import saved, wire
from kvfork.backends.lockstep.channel import Channel
from kvfork.backends.lockstep.loading import load_in_step

log = logging.getLogger("kvfork.lockstep")


class Follower:
    """One follower rank: its sessions by rank 0's ids (an Executor), and the effects that need the
    other ranks too (Load, Export, Import)."""

    def __init__(self, backend: Backend, channel: Channel):
        self.backend, self.channel = backend, channel
        self.ex = e.Executor(backend)
        self.received = 0
        self.open_at_stop = 0

    def run(self) -> str:
        """Run broadcasts until a Stop; returns its reason. Raises when the stream of broadcasts breaks."""
        while True:
            broadcast = wire.decode(self.channel.broadcast(None))
            self.received += 1
            if broadcast.seq != self.received:
                raise RuntimeError(f"broadcast {broadcast.seq} arrived when {self.received} was due")
            for effect in broadcast.effects:
                if isinstance(effect, wire.Stop):
                    self.open_at_stop = len(self.ex.sessions)  # rank 0 holds as many (it releases them too)
                    self.release_all()
                    return effect.reason
                self.apply(effect)

    def apply(self, effect: e.Effect | wire.Load) -> None:
        match effect:
            case wire.Load(folder, dtype, clone_mode, kv_cache_dtype, kv_group_size):
                self.backend.set_clone_mode(clone_mode)  # type: ignore[arg-type]
                self.backend.set_kv_storage(KVStorage(kv_cache_dtype, kv_group_size))
                load_in_step(self.backend, self.channel, folder, dtype)
            case e.Export():
                self.export(effect)
            case e.Import():
                self.import_state(effect)
            case _:
                self.ex.run(effect)

    def export(self, effect: e.Export) -> None:
        """This rank's shard of the state, gathered on rank 0."""
        try:
            shard = self.ex.run(effect)
        except Exception as exc:
            log.warning("exporting a state failed: %r", exc)
            self.channel.all_ok(False)
            return
        if self.channel.all_ok(True):
            self.channel.gather(saved.to_bytes(shard))

    def import_state(self, effect: e.Import) -> None:
        """This rank's part of the whole state rank 0 sent."""
        ok = True
        try:
            self.ex.run(e.Import(effect.sid, saved.shard(effect.state, self.channel.rank, self.channel.size)))
        except Exception as exc:
            log.warning("loading a state failed: %r", exc)
            ok = False
        if not self.channel.all_ok(ok) and ok:
            self.ex.run(e.Release([effect.sid]))

    def release_all(self) -> None:
        self.ex.run(e.Release(list(self.ex.sessions)))
