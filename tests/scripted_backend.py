"""A Backend that emits chosen tokens with controllable delays, for engine tests.

Each session holds its committed token ids. The next token is a hash of the
whole committed sequence, so any state an engine bug corrupts (a wrong clone, a
wrong resume) shows up as different tokens; warm, cloned and cold runs must agree
exactly. A sliding window (ring of `window` positions) makes clones refusable by
the same rule as the real backends. Tests steer the runner with:
- `delay`: seconds each call of a kind sleeps;
- `gates`: a `Gate` per call kind that holds the runner inside that call until
  the test opens it (the runner thread blocks, the test's loop does not);
- `fail`: (kind, sessions, inputs) -> what a call does instead of running
  (inputs: the chunks of a prefill, the tokens of a decode): False runs it;
  True raises before touching anything (for prefill and decode, a BatchFailed
  with every row UNTOUCHED); a list of RowState raises BatchFailed after doing
  that to each row (COMMITTED commits it, CORRUPT commits a wrong token), with
  logits unless `withhold_logits`; an exception instance is raised as it is,
  before anything runs (for prefill and decode: a ValueError is check_inputs'
  refusal, anything else a backend bug);
- `sample_fail`: a predicate on one row's SamplerState making `sample` raise
  (before it changes anything, as the real samplers);
- `refuse`: a predicate (session, upto) -> reason or None forcing a clone refusal;
- `calls`: every call, in order, for assertions on what ran when.
Sampling honours a row's grammar mask (`SamplerState.allowed`): a token the mask
forbids gives way to the lowest one it allows.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from kvfork.backends.base import (Backend, BatchFailed, CloneRefused, KVCost, LayerAttention, ModelInfo, RowState, Sampled,
                           SamplerState, Session, check_inputs, clone_refusal)

EOS = 2
VOCAB = 512
BYTES_PER_TOKEN = 1024


def next_token(sequence: Sequence[int]) -> int:
    """Deterministic in the whole sequence; never EOS unless a script says so."""
    h = 1469598103934665603
    for t in sequence:
        h = ((h ^ t) * 1099511628211) & 0xFFFFFFFFFFFF
    return 3 + h % (VOCAB - 3)


def allowed_pick(token: int, allowed: np.ndarray) -> int:
    """The scripted token if the row's grammar mask allows it, else the lowest token it allows."""
    bits = np.unpackbits(allowed.view(np.uint8), bitorder="little")
    assert bits.any(), "a backend is never asked to sample a row whose mask allows nothing"
    return token if bits[token] else int(np.flatnonzero(bits)[0])


class Gate:
    """Holds the runner inside the first backend call of its kind for which `when(sessions, inputs)` holds,
    until the test opens it. A gate the runner leaves by its timeout instead (the test never opened it, and
    passed only by waiting) is noted in `Gate.expired`: conftest fails that test."""

    TIMEOUT_S = 30.0  # guards against a hang only
    expired: list[str] = []

    def __init__(self, when: Callable[[Sequence[Session], Sequence], bool] = lambda sessions, inputs: True) -> None:
        self.when = when
        self.reached = threading.Event()
        self.opened = threading.Event()

    def wait_here(self) -> None:
        self.reached.set()
        if not self.opened.wait(timeout=self.TIMEOUT_S):
            Gate.expired.append(f"a gate held the runner {self.TIMEOUT_S:g} s and was never opened")

    def open(self) -> None:
        self.opened.set()


class ScriptedSession(Session):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def commit(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        self.position = len(self.tokens)


class ScriptedBackend(Backend):
    def __init__(self, window: int | None = None, context_length: int = 4096,
                 script: Callable[[Sequence[int]], int] = next_token):
        self.window, self.context_length, self.script = window, context_length, script
        self.delay: dict[str, float] = {}
        self.gates: dict[str, Gate] = {}
        self.fail: Callable[[str, Sequence[Session], Sequence], Any] = lambda kind, sessions, inputs: False
        self.withhold_logits = False
        self.sample_fail: Callable[[SamplerState], bool] = lambda state: False
        self.refuse: Callable[[Session, int], str | None] = lambda session, upto: None
        self.calls: list[tuple] = []
        self._open: dict[int, ScriptedSession] = {}
        self.loaded_on: threading.Thread | None = None

    def _enter(self, kind: str, sessions: Sequence[Session] = (), inputs: Sequence = ()) -> Any:
        """Gates and delays; then what `fail` says (raised here when nothing runs)."""
        gate = self.gates.get(kind)
        if gate is not None and gate.when(sessions, inputs):
            del self.gates[kind]
            gate.wait_here()
        if self.delay.get(kind):
            time.sleep(self.delay[kind])
        fault = self.fail(kind, sessions, inputs)
        if isinstance(fault, BaseException):
            raise fault
        if fault is True:
            cause = RuntimeError(f"scripted {kind} failure")
            if kind in ("prefill", "decode"):
                raise BatchFailed(cause, [RowState.UNTOUCHED] * len(sessions))
            raise cause
        return fault

    def _forward(self, kind: str, sessions: Sequence[Session], rows: Sequence[Sequence[int]],
                 inputs: Sequence) -> list[int]:
        check_inputs(sessions, rows, self._open, self.info)
        fault = self._enter(kind, sessions, inputs)
        states = list(fault) if fault else [RowState.COMMITTED] * len(sessions)
        for s, row, state in zip(sessions, rows, states):
            if state is RowState.COMMITTED:
                s.commit(row)  # type: ignore[attr-defined]
            elif state is RowState.CORRUPT:
                s.commit([(t + 1) % VOCAB for t in row])  # type: ignore[attr-defined]
        logits = [self.script(s.tokens) for s in sessions]  # type: ignore[attr-defined]
        if fault:
            raise BatchFailed(RuntimeError(f"scripted {kind} failure"), states,
                              None if self.withhold_logits else logits)
        return logits

    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        self.loaded_on = threading.current_thread()
        self._enter("load")
        layers = (LayerAttention("full"),) if self.window is None else (
            LayerAttention("sliding", self.window), LayerAttention("full"))
        self.info = ModelInfo("scripted", VOCAB, self.context_length, layers, (EOS,), KVCost(BYTES_PER_TOKEN),
                              "float32", "cpu")
        return self.info

    def open_session(self) -> ScriptedSession:
        session = ScriptedSession()
        self._open[session.id] = session
        return session

    def release(self, session: Session) -> None:
        self._open.pop(session.id, None)

    def prefill(self, sessions: Sequence[Session], chunks: Sequence[Sequence[int]]) -> list[int]:
        self.calls.append(("prefill", [(s.id, len(c)) for s, c in zip(sessions, chunks)]))
        return self._forward("prefill", sessions, chunks, chunks)

    def decode(self, sessions: Sequence[Session], tokens: Sequence[int]) -> list[int]:
        self.calls.append(("decode", [s.id for s in sessions]))
        return self._forward("decode", sessions, [[t] for t in tokens], tokens)

    def sample(self, logits: list[int], states: Sequence[SamplerState]) -> list[Sampled]:
        if any(self.sample_fail(state) for state in states):
            raise RuntimeError("scripted sample failure")
        picks = [t if st.allowed is None else allowed_pick(t, st.allowed) for t, st in zip(logits, states)]
        for t, state in zip(picks, states):
            state.output.append(t)  # as every backend's sampler does
        return [Sampled(t, 0.0 if st.params.logprobs else None) for t, st in zip(picks, states)]

    def select_rows(self, logits: list[int], rows: Sequence[int]) -> list[int]:
        return [logits[i] for i in rows]

    def clone(self, session: Session, upto: int) -> ScriptedSession:
        self.calls.append(("clone", session.id, upto))
        self._enter("clone", [session])
        assert isinstance(session, ScriptedSession) and session.id in self._open, "clone of a released session"
        held_from = [] if self.window is None else [max(0, session.position - self.window)]
        refusal = clone_refusal(session.position, upto, self.info, held_from)
        reason = refusal.reason if refusal else self.refuse(session, upto)
        if reason:
            raise CloneRefused(reason)
        copy = self.open_session()
        copy.commit(session.tokens[:upto])
        return copy

    def session_bytes(self, session: Session) -> int:
        return BYTES_PER_TOKEN * session.position

    def total_bytes(self) -> int:
        return sum(self.session_bytes(s) for s in list(self._open.values()))

    def live_sessions(self) -> int:
        return len(self._open)

    def to_numpy(self, logits: Any) -> Any:
        out = np.zeros((len(logits), VOCAB), np.float32)
        out[np.arange(len(logits)), logits] = 1.0
        return out

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        """What a lone request on this script generates (for reference outputs)."""
        seq, out = list(prompt), []
        for _ in range(n):
            t = self.script(seq)
            out.append(t)
            seq.append(t)
        return out


class ReadsImages(ScriptedBackend):
    """A model that reads images: each image token's embeddings take EMBEDDING bytes while its request runs; its
    sessions roll back (a named session stopped inside an image)."""

    EMBEDDING = 300

    def load(self, folder: str, dtype: str | None = None) -> ModelInfo:
        self.info = dataclasses.replace(super().load(folder, dtype), reads_images=True,
                                        image_token_bytes=self.EMBEDDING)
        return self.info

    def encode_images(self, images: Sequence[Any], scope: str) -> int:
        return len(images)

    def truncate(self, session: Session, position: int) -> None:
        assert isinstance(session, ScriptedSession) and position <= session.position
        session.tokens = session.tokens[:position]
        session.position = position
