"""Rank 0's backend: its own shard of the model, with every effect sent to the other ranks first.

The engine and its runner see one `Backend`. Each call that changes state runs here and is recorded
as the effect that runs it (backends/effects.py: the values of the engine's step plan), its sessions
named by their Session.id; each call that runs collectives (prefill, decode, export, import) first sends
the effects recorded since the last one, itself last, as one broadcast (wire.py), so every rank runs
the same calls in the same order, faults.py's retries included. Queries (bytes, live sessions) and
sampling are rank 0's alone: every rank holds the same shard sizes, and rank 0's logits are whole
(the model gathers them).

Faults:
- a refused call (check_inputs, CloneRefused), or an export or import that fails on rank 0, fails
  here before anything is recorded;
- a call that fails in a collective, or on rank 0 mid-pass, leaves the ranks' states apart: the
  group has failed (`RanksFailed`, which the runner cannot take for one request's fault), and every
  later call raises it at once. An export or import that fails on another rank is optional work:
  every rank learns it (channel.all_ok) and drops it;
- a step that waits on the other ranks longer than `timeout` is a stalled rank: the watchdog
  declares the group failed and tells `on_fault` (the runner stays blocked in the collective: MLX's
  take no timeout), so the engine answers its requests without it.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from typing import Any, Callable, Collection, Sequence

import numpy as np

from kvfork.backends import effects as e
from kvfork.backends.base import (Backend, BatchFailed, KVStorage, ModelInfo, Sampled, SamplerState, SavedState, Session,
                                  check_inputs)
from kvfork.backends.device_memory import DeviceMemory
from kvfork.backends.lockstep import saved, wire
from kvfork.backends.lockstep.channel import Channel
from kvfork.backends.lockstep.loading import load_in_step

log = logging.getLogger("kvfork.lockstep")


class RanksFailed(BaseException):
    """The ranks' states can no longer be trusted to agree: every request on them ends. A BaseException,
    so no handler of one request's fault takes it for one."""

    def __repr__(self) -> str:
        return str(self)


def peers(size: int) -> str:
    """The other ranks, in words: which of them failed, as far as rank 0 can tell."""
    return "rank 1" if size == 2 else f"one of ranks 1-{size - 1}"


class LockstepBackend(Backend):
    def __init__(self, local: Backend, channel: Channel, timeout: float):
        self.local, self.channel = local, channel
        self.mixed_batches, self.pads_verify = local.mixed_batches, local.pads_verify
        self._live: set[int] = set()  # the ids of the sessions it handed out, their sids on every rank
        self._pending: list[e.Effect] = []
        self._sent = itertools.count(1)
        self._clone_mode = "share"
        self._kv_storage = KVStorage()
        self.failed: str | None = None
        self.stopped = False  # a Stop went round: every rank has left
        self.broadcast_seconds = 0.0  # time spent sending effects (docs/benchmarks.md: the overhead of ranks)
        self._watchdog = StallWatchdog(timeout, self._stalled)
        self.on_fault: Callable[[str], None] = lambda reason: None  # told, from any thread, when the group fails

    @property
    def state_format(self) -> str:
        return f"{self.local.state_format}x{self.channel.size}"

    def memory(self, step_tokens: int) -> DeviceMemory:
        """Rank 0's device, unmeasured: a step on rank 0 alone would wait on collectives no other rank joins."""
        return self.local.memory(0)

    # -- the effects ----------------------------------------------------

    def _record(self, effect: e.Effect) -> None:
        self._pending.append(effect)

    def _send(self, effect: e.Effect | wire.Load | wire.Stop) -> None:
        """Send every effect recorded, `effect` last, as one broadcast."""
        self._check()
        effects, self._pending = [*self._pending, effect], []
        t0 = time.perf_counter()
        self._guarded(self.channel.broadcast, wire.encode(wire.Broadcast(next(self._sent), effects)))
        self.broadcast_seconds += time.perf_counter() - t0

    def _guarded(self, fn: Callable, *args: Any) -> Any:
        """A call that runs collectives: watched, and a failure fails the group."""
        self._check()
        self._watchdog.begin()
        try:
            return fn(*args)
        except Exception as exc:
            cause = exc.cause if isinstance(exc, BatchFailed) else exc
            self._fail(f"{peers(self.channel.size)} failed or was lost: {fn.__name__} stopped with "
                       f"{type(cause).__name__}: {_gist(cause)}")
            raise RanksFailed(self.failed) from exc
        finally:
            self._watchdog.end()

    def _check(self) -> None:
        if self.failed is not None:
            raise RanksFailed(self.failed)

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.error("distributed serving stopped: %s", reason)
            self.on_fault(reason)

    def _stalled(self, seconds: float) -> None:
        self._fail(f"{peers(self.channel.size)} stopped answering: a step waited {seconds:.0f} s on the other "
                   "ranks (--rank-timeout)")

    def _hand_out(self, session: Session) -> int:
        self._live.add(session.id)
        return session.id

    def stop(self, reason: str) -> None:
        """Tell every rank to leave (after the runner has stopped): releases still recorded go first."""
        try:
            if self.failed is None:
                self._send(wire.Stop(reason))
                self.stopped = True
        except RanksFailed:
            pass  # the others are gone already
        finally:
            self._watchdog.close()

    # -- model and sessions ---------------------------------------------

    def set_clone_mode(self, mode) -> None:
        self._clone_mode = mode
        self.local.set_clone_mode(mode)

    def set_kv_storage(self, storage: KVStorage) -> None:
        self._kv_storage = storage
        self.local.set_kv_storage(storage)

    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        self._send(wire.Load(folder, dtype, self._clone_mode, self._kv_storage.dtype, self._kv_storage.group))
        try:
            self.info = load_in_step(self.local, self.channel, folder, dtype)
        except Exception as exc:
            self._fail(f"loading the model failed: {exc}")
            raise
        return self.info

    def open_session(self) -> Session:
        session = self.local.open_session()
        self._record(e.Open(self._hand_out(session)))
        return session

    def release(self, session: Session) -> None:
        live = session.id in self._live
        self._live.discard(session.id)
        self.local.release(session)
        if not live:  # releasing twice is a no-op (Backend.release)
            return
        last = self._pending[-1] if self._pending else None  # a request's sessions leave together: one effect
        if isinstance(last, e.Release):
            self._pending[-1] = e.Release([*last.sids, session.id])
        else:
            self._record(e.Release([session.id]))

    def clone(self, session: Session, upto: int) -> Session:
        self._check()
        clone = self.local.clone(session, upto)  # a refusal records nothing
        self._record(e.Clone(self._hand_out(clone), session.id, upto))
        return clone

    def keep_at(self, session: Session, positions: Collection[int]) -> None:
        self.local.keep_at(session, positions)
        self._record(e.KeepAt(session.id, tuple(sorted(positions))))

    def move_checkpoints(self, source: Session, target: Session) -> None:
        self.local.move_checkpoints(source, target)
        self._record(e.MoveCheckpoints(source.id, target.id))

    def truncate(self, session: Session, position: int) -> None:
        self.local.truncate(session, position)
        self._record(e.Truncate(session.id, position))

    @property
    def rolls_back(self) -> bool:
        return self.local.rolls_back

    # -- compute ---------------------------------------------------------

    def prefill(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]]) -> Any:
        check_inputs(sessions, chunks, self._live, self.info)  # a refusal reaches no rank
        self._send(e.Prefill([s.id for s in sessions], [list(c) for c in chunks]))
        return self._guarded(self.local.prefill, sessions, chunks)

    def verify(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]], reads: Sequence[int]) -> Any:
        check_inputs(sessions, chunks, self._live, self.info)
        self._send(e.Verify([s.id for s in sessions], [list(c) for c in chunks], list(reads)))
        return self._guarded(self.local.verify, sessions, chunks, reads)

    def decode(self, sessions: Sequence[Session], tokens: Sequence[int]) -> Any:
        check_inputs(sessions, [[t] for t in tokens], self._live, self.info)
        self._send(e.Decode([s.id for s in sessions], list(tokens)))
        return self._guarded(self.local.decode, sessions, tokens)

    def sample(self, logits: Any, states: Sequence[SamplerState]) -> list[Sampled]:
        return self.local.sample(logits, states)

    def select_rows(self, logits: Any, rows: Sequence[int]) -> Any:
        return self.local.select_rows(logits, rows)

    # -- saved states (optional work: a rank that fails one, fails it on every rank) ------

    def export_state(self, session: Session) -> SavedState:
        self._check()
        shard = self.local.export_state(session)
        self._send(e.Export(session.id))
        if not self._guarded(self.channel.all_ok, True):
            raise RuntimeError("exporting the state failed on another rank (its log says why)")
        parts = self._guarded(self.channel.gather, saved.to_bytes(shard))
        return saved.join([saved.from_bytes(shard, part) for part in parts])

    def import_state(self, state: SavedState) -> Session:
        self._check()
        session = self.local.import_state(saved.shard(state, 0, self.channel.size))
        self._send(e.Import(session.id, state))  # whole: each rank keeps its part
        if not self._guarded(self.channel.all_ok, True):
            self.local.release(session)
            raise RuntimeError("loading the state failed on another rank (its log says why)")
        self._hand_out(session)
        return session

    # -- rank 0's own accounting: every rank holds the same ------------------

    def session_bytes(self, session: Session) -> int:
        return self.local.session_bytes(session)

    def release_frees(self, session: Session) -> int:
        return self.local.release_frees(session)

    def pooled_bytes(self) -> int:
        return self.local.pooled_bytes()

    def block_stats(self):
        return self.local.block_stats()

    def total_bytes(self) -> int:
        return self.local.total_bytes()

    def live_sessions(self) -> int:
        return self.local.live_sessions()

    def to_numpy(self, logits: Any) -> np.ndarray:
        return self.local.to_numpy(logits)


def _gist(exc: BaseException) -> str:
    """The first sentence of an error, without a C++ source location ("[.../pair.cc:553] ")."""
    text = re.sub(r"^\[[^\]]*\] ", "", str(exc).strip())
    return text.split(". ")[0][:200]


class StallWatchdog:
    """Calls `on_stall(seconds)` once when a watched section runs past `timeout` seconds."""

    def __init__(self, timeout: float, on_stall: Callable[[float], None]):
        self.timeout, self.on_stall = timeout, on_stall
        self._since: float | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="kvfork-rank-watchdog", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._since = time.monotonic()
        self._wake.set()

    def end(self) -> None:
        self._since = None

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _watch(self) -> None:
        while not self._closed:
            since = self._since
            if since is None:
                self._wake.wait()
                self._wake.clear()
                continue
            late = time.monotonic() - since
            if late >= self.timeout and self._since == since:
                self.on_stall(late)
                return
            time.sleep(min(self.timeout - late, 1.0) if late < self.timeout else 0.1)
