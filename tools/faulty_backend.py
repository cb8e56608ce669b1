"""A backend wrapper that injects faults at random: test-only, for `kvfork soak`.

It wraps a real, loaded-by-the-engine backend and is handed to an in-process
daemon by tools/soak.py; no flag of `kvfork serve` can reach it.

Faults obey the contract of backends/base.py:
- prefill / decode, "batch": raised before the real call, so every row is
  UNTOUCHED (a runner may run them again);
- prefill / decode, "row": charged to one row k, raised before the real call:
  row k is reported CORRUPT (it must never be read again), the others UNTOUCHED;
- sample, "batch": raised before the real sample, charged to nobody (a runner
  re-samples row by row); "row": charged to one request, whose sampler then
  fails on every later call, as a bad sampling input would;
- clone and capture (a clone at the prompt length right after its last prefill
  chunk): a RuntimeError, or a MemoryError as an allocation that runs out would.

Every fault is recorded with the tokens of the sessions it touched (each session's
committed history, tracked here), the seeds of the samplers it touched, and when,
so the soak can tell which requests a fault could have hit. "Hard" faults (a
CORRUPT row, a charged sampler) may fail their own request; so may a "batch"
fault that strikes a lone session or sampler again on the very next call of its
kind, right after one struck it alone: the runner's contract charges a failure
that stays when run alone twice, and a draw cannot tell transient from lasting.
Every other fault is optional work or retryable and must fail nobody.

It also watches, on the runner thread, what a checker outside cannot see between
steps: the bytes the backend holds after every call (against the KV budget), and
any read of a session it reported CORRUPT.
"""

from __future__ import annotations

import asyncio
import random
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

from kvfork.backends.base import Backend, BatchFailed, ModelInfo, RowState, Sampled, SamplerState, SavedState, Session
from kvfork.backends.device_memory import DeviceMemory

KINDS = ("prefill", "decode", "sample", "clone", "capture")


class InjectedFault(RuntimeError):
    """What the wrapper raises (MemoryError stands in for an out-of-memory clone)."""


@dataclass(frozen=True)
class Fault:
    id: int
    kind: str  # one of KINDS
    mode: str  # "batch", "row", "error" or "oom" (clones)
    at: float  # time.monotonic()
    tokens: tuple[tuple[int, ...], ...]  # per touched session: the tokens it held or was about to hold
    seeds: tuple[int | None, ...] = ()  # per touched sampler (sample faults)
    again_alone: bool = False  # a batch fault on the lone session or sampler the previous call's fault hit alone

    @property
    def hard(self) -> bool:
        """May fail the request it hit; every other fault must fail nobody."""
        return self.kind in ("prefill", "decode", "sample") and (self.mode == "row" or self.again_alone)


@dataclass
class FaultLog:
    """What the wrapper saw on the runner thread."""

    faults: list[Fault] = field(default_factory=list)
    corrupt_reads: list[tuple[int, str]] = field(default_factory=list)  # (session id, what): CORRUPT, used again
    over_budget: int = 0  # calls after which the backend held more than the budget
    peak_bytes: int = 0
    held_bytes: int = 0  # after the last call
    live_sessions: int = 0
    calls: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})


class FaultyBackend(Backend):
    def __init__(self, inner: Backend, seed: int, rate: float, budget_bytes: int):
        self.inner, self.rate, self.budget_bytes = inner, rate, budget_bytes
        self.rng = random.Random(seed)  # drawn from on the runner thread only
        self.enabled = False  # off for the warm-up and the drain; the soak turns it on
        self.watch = FaultLog()
        self._history: dict[int, list[int]] = {}  # session id -> committed tokens
        self._corrupt: set[int] = set()
        # id -> (the sampler, the fault that charged it); by id: SamplerState compares by value
        self._charged: dict[int, tuple[weakref.ref, int]] = {}
        self._just_prefilled: dict[int, int] = {}  # session id -> position, after its last prefill call
        # kind -> the lone session id (or sampler id) a batch fault struck on the last call of that kind
        self._struck_alone: dict[str, int | None] = {}
        self._watches: dict[int, tuple[list[int], asyncio.Future, asyncio.AbstractEventLoop]] = {}

    # ---- bookkeeping ----

    def _draw(self, kind: str) -> bool:
        self.watch.calls[kind] += 1
        return self.enabled and self.rng.random() < self.rate

    def _record(self, kind: str, mode: str, tokens: Sequence[Sequence[int]], seeds: Sequence[int | None] = (),
                touched: Sequence[int] = ()) -> Fault:
        """`touched`: the ids of the sessions or samplers a retryable fault hit, to tell a repeat on one alone."""
        lone = touched[0] if len(touched) == 1 and mode == "batch" else None
        again = lone is not None and self._struck_alone.get(kind) == lone
        self._struck_alone[kind] = lone
        fault = Fault(len(self.watch.faults) + 1, kind, mode, time.monotonic(), tuple(tuple(t) for t in tokens),
                      tuple(seeds), again)
        self.watch.faults.append(fault)
        return fault

    def _read(self, sessions: Sequence[Session], what: str) -> None:
        for s in sessions:
            if s.id in self._corrupt:
                self.watch.corrupt_reads.append((s.id, f"{what} on {s!r}, reported corrupt"))

    def _measure(self) -> None:
        held = self.inner.total_bytes()
        self.watch.held_bytes, self.watch.live_sessions = held, self.inner.live_sessions()
        self.watch.peak_bytes = max(self.watch.peak_bytes, held)
        if held > self.budget_bytes:
            self.watch.over_budget += 1

    def _batch_fault(self, kind: str, sessions: Sequence[Session], rows: Sequence[Sequence[int]]) -> None:
        if not self._draw(kind):
            self._struck_alone[kind] = None
            return
        tokens = [self._history.get(s.id, []) + list(row) for s, row in zip(sessions, rows)]
        if self.rng.random() < 0.5:
            fault = self._record(kind, "batch", tokens, touched=[s.id for s in sessions])
            states = [RowState.UNTOUCHED] * len(sessions)
        else:
            k = self.rng.randrange(len(sessions))
            fault = self._record(kind, "row", [tokens[k]])
            states = [RowState.CORRUPT if i == k else RowState.UNTOUCHED for i in range(len(sessions))]
            self._corrupt.add(sessions[k].id)
        raise BatchFailed(InjectedFault(f"injected {kind} fault #{fault.id} ({fault.mode}"
                                        f"{', again alone' if fault.again_alone else ''})"), states)

    def when_holds(self, tokens: Sequence[int]) -> asyncio.Future:
        """A future on the calling loop, done once some session has committed `tokens` (a prefix of its
        history): the runner thread resolves it right after the prefill that got there."""
        loop = asyncio.get_running_loop()
        done, want = loop.create_future(), list(tokens)
        self._watches[id(done)] = (want, done, loop)
        if any(h[:len(want)] == want for h in list(self._history.values())):
            self._resolve(id(done))
        return done

    def _resolve(self, key: int) -> None:
        watch = self._watches.pop(key, None)
        if watch is not None:
            _, done, loop = watch
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    def _check_watches(self, sessions: Sequence[Session]) -> None:
        for key, (want, _, _) in list(self._watches.items()):
            if any(self._history[s.id][:len(want)] == want for s in sessions if s.id in self._history):
                self._resolve(key)

    # ---- the Backend API ----

    @property
    def mixed_batches(self) -> bool:  # one pass per step exactly when the real backend runs it
        return self.inner.mixed_batches

    @property
    def pads_verify(self) -> bool:  # the policy prices drafts as the real backend runs them
        return self.inner.pads_verify

    @property
    def vision(self) -> Any:  # the real backend's image reader (its encode_images and release_images run there)
        return self.inner.vision

    @property
    def state_format(self) -> str:  # its saved states are the real backend's
        return self.inner.state_format

    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        self.info = self.inner.load(folder, dtype)
        return self.info

    @property
    def reusable(self) -> Any:  # what the real backend's next load starts from
        return self.inner.reusable

    def built(self) -> Any:
        return self.inner.built()

    def reuse(self, built: Any) -> None:
        self.inner.reuse(built)

    def encode_images(self, images: Sequence[Any], scope: str) -> int:
        return self.inner.encode_images(images, scope)

    def release_images(self, images: Sequence[int]) -> None:
        self.inner.release_images(images)

    def open_session(self) -> Session:
        session = self.inner.open_session()
        self._history[session.id] = []
        self._measure()
        return session

    def release(self, session: Session) -> None:
        self.inner.release(session)
        self._history.pop(session.id, None)
        self._just_prefilled.pop(session.id, None)
        self._measure()

    def prefill(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]]) -> Any:
        self._read(sessions, "prefill")
        self._batch_fault("prefill", sessions, chunks)
        logits = self.inner.prefill(sessions, chunks)
        for s, chunk in zip(sessions, chunks):
            self._history.setdefault(s.id, []).extend(chunk)
            self._just_prefilled[s.id] = s.position
        self._check_watches(sessions)
        self._measure()
        return logits

    @property
    def rolls_back(self) -> bool:
        return self.inner.rolls_back

    def verify(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]], reads: Sequence[int]) -> Any:
        self._read(sessions, "verify")
        self._batch_fault("prefill", sessions, chunks)  # one pass of the same kind: its faults count as prefill's
        logits = self.inner.verify(sessions, chunks, reads)
        for s, chunk in zip(sessions, chunks):
            self._history.setdefault(s.id, []).extend(chunk)
            self._just_prefilled.pop(s.id, None)
        self._measure()
        return logits

    def truncate(self, session: Session, position: int) -> None:
        self._read([session], "truncate")
        self.inner.truncate(session, position)
        del self._history.setdefault(session.id, [])[position:]

    def decode(self, sessions: Sequence[Session], tokens: Sequence[int]) -> Any:
        self._read(sessions, "decode")
        self._batch_fault("decode", sessions, [[t] for t in tokens])
        logits = self.inner.decode(sessions, tokens)
        for s, token in zip(sessions, tokens):
            self._history.setdefault(s.id, []).append(token)
            self._just_prefilled.pop(s.id, None)
        self._measure()
        return logits

    def sample(self, logits: Any, states: Sequence[SamplerState]) -> list[Sampled]:
        charged = [(st, c[1]) for st in states if (c := self._charged.get(id(st))) is not None and c[0]() is st]
        if charged:  # a request whose sampling was made to fail keeps failing, as bad input would
            st, fault_id = charged[0]  # named, so a request without a seed of its own is excused by it
            raise InjectedFault(f"injected sample fault #{fault_id} on seed {st.params.seed} (again)")
        if self._draw("sample"):
            real = [st for st in states if st.prompt]  # rows the runner discards have no prompt
            if self.rng.random() < 0.5 or not real:
                fault = self._record("sample", "batch", [list(st.prompt) + st.output for st in states],
                                     [st.params.seed for st in states], touched=[id(st) for st in real])
            else:
                st = self.rng.choice(real)
                fault = self._record("sample", "row", [list(st.prompt) + st.output], [st.params.seed])
                self._charged[id(st)] = (weakref.ref(st), fault.id)
            raise InjectedFault(f"injected sample fault #{fault.id} ({fault.mode}"
                                f"{', again alone' if fault.again_alone else ''})")
        self._struck_alone["sample"] = None
        return self.inner.sample(logits, states)

    def select_rows(self, logits: Any, rows: Sequence[int]) -> Any:
        return self.inner.select_rows(logits, rows)

    def clone(self, session: Session, upto: int) -> Session:
        self._read([session], "clone")
        kind = "capture" if self._just_prefilled.get(session.id) == upto else "clone"
        if self._draw(kind):
            oom = self.rng.random() < 0.5
            fault = self._record(kind, "oom" if oom else "error", [self._history.get(session.id, [])[:upto]])
            message = f"injected {kind} fault #{fault.id}"
            raise MemoryError(message) if oom else InjectedFault(message)
        copy = self.inner.clone(session, upto)
        self._history[copy.id] = self._history.get(session.id, [])[:upto]
        self._measure()
        return copy

    def keep_at(self, session: Session, positions: Collection[int]) -> None:
        self._read([session], "keep_at")
        self.inner.keep_at(session, positions)
        self._measure()

    def move_checkpoints(self, source: Session, target: Session) -> None:
        self._read([source, target], "move_checkpoints")
        self.inner.move_checkpoints(source, target)

    def export_state(self, session: Session) -> SavedState:
        self._read([session], "export_state")
        return self.inner.export_state(session)

    def import_state(self, state: SavedState) -> Session:
        session = self.inner.import_state(state)
        self._history[session.id] = []  # its tokens are the disk tier's to know
        self._measure()
        return session

    def set_clone_mode(self, mode) -> None:
        self.inner.set_clone_mode(mode)

    def set_kv_storage(self, storage) -> None:
        self.inner.set_kv_storage(storage)

    def set_encoder_cache_bytes(self, nbytes: int) -> None:
        self.inner.set_encoder_cache_bytes(nbytes)

    def set_batch_invariant(self, on: bool) -> None:
        self.inner.set_batch_invariant(on)

    def session_bytes(self, session: Session) -> int:
        return self.inner.session_bytes(session)

    def release_frees(self, session: Session) -> int:
        return self.inner.release_frees(session)

    def memory(self, step_tokens: int) -> DeviceMemory:
        return self.inner.memory(step_tokens)

    def pooled_bytes(self) -> int:
        return self.inner.pooled_bytes()

    def block_stats(self):
        return self.inner.block_stats()

    def total_bytes(self) -> int:
        return self.inner.total_bytes()

    def live_sessions(self) -> int:
        return self.inner.live_sessions()

    def to_numpy(self, logits: Any) -> Any:
        return self.inner.to_numpy(logits)
