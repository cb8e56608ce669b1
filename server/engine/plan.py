"""The step as data: every backend effect of one runner step, as a plain value.

    StepPlan     what one step runs: the session effects since the last forward pass (`ops`,
                 in the order they ran), the samplers opened, the decode rows and prefill
                 chunks of its forward pass(es), and which rows are sampled by which sampler
    encode(plan) -> bytes, decode(data) -> StepPlan     msgpack, through msgspec
    Executor     one backend's sessions by id, and the one place each effect is run
    replay(plans, backend) -> {rid: tokens}    run recorded plans again, on a fresh backend

Design rules:
- sessions are named by ids the runner gives them (`sid`), never by object, so a plan
  runs from itself alone: on a fresh backend (`replay`), or on another rank of one model;
- an op is recorded once it ran: a clone the backend refused changed nothing and is not
  in the plan; a clone that ran after the last pass of step k (a capture, a choice, a
  follower's order, a release) is among step k + 1's `ops`, which run before its pass;
- the rows of a pass: every decode row and prefill chunk in one `prefill` call on a
  backend with `mixed_batches` (torch), else the decode rows, then the prefill chunks;
- the plan is what the runner decided before its forward pass; a forward pass that fails
  is recovered from by faults.py on this rank alone (the plan is not rewritten for it);
- sampling reads the plan's rows' logits only; a decode row carries the token it
  commits, so a rank that does not sample runs the next step from the plan alone.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import msgspec
import numpy as np

from backends.base import Backend, SamplerState, SamplingParams, SavedState, Session


class Open(msgspec.Struct, tag=True, frozen=True):
    sid: int  # an empty session


class Clone(msgspec.Struct, tag=True, frozen=True):
    sid: int  # a new session holding [0, upto) of `source`
    source: int
    upto: int


class Import(msgspec.Struct, tag=True, frozen=True):
    sid: int  # a new session holding a state read from the disk tier
    state: SavedState


class Export(msgspec.Struct, tag=True, frozen=True):
    sid: int  # its state to the host (the disk tier); the session is unchanged


class KeepAt(msgspec.Struct, tag=True, frozen=True):
    sid: int  # keep the recurrent state at these positions (Backend.keep_at)
    positions: tuple[int, ...]


class MoveCheckpoints(msgspec.Struct, tag=True, frozen=True):
    source: int
    target: int


class Release(msgspec.Struct, tag=True, frozen=True):
    sids: list[int]


Op = Open | Clone | Import | Export | KeepAt | MoveCheckpoints | Release


class Row(msgspec.Struct, frozen=True):
    """One row of a forward pass: a prefill chunk, or a decode row's one token."""

    rid: int  # the request it belongs to
    sid: int
    tokens: list[int]
    logits: bool  # its last logits are read: a decode row, or the chunk that ends its prompt
    prefill: bool


class Sampler(msgspec.Struct, frozen=True):
    """A request's sampler, opened this step (its stream starts at its seed)."""

    rid: int
    params: SamplingParams
    prompt: list[int]


class Sample(msgspec.Struct, frozen=True):
    rid: int  # whose sampler picks
    row: int  # the request whose row's logits it reads (its own, or its lead's: n choices)


class StepPlan(msgspec.Struct):
    step: int
    ops: list[Op] = []
    samplers: list[Sampler] = []
    decode: list[Row] = []
    prefill: list[Row] = []
    samples: list[Sample] = []
    mixed: bool = False  # one pass of every row (Backend.mixed_batches), else decode then prefill

    def passes(self) -> list[list[Row]]:
        if self.mixed:
            return [self.decode + self.prefill] if self.decode or self.prefill else []
        return [rows for rows in (self.decode, self.prefill) if rows]

    @property
    def prefill_tokens(self) -> int:
        return sum(len(row.tokens) for row in self.prefill)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": np.ascontiguousarray(obj).tobytes()}
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        return np.frombuffer(obj["data"], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    raise NotImplementedError(f"cannot decode {kind.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(StepPlan, dec_hook=_dec_hook)


def encode(plan: StepPlan) -> bytes:
    return _ENCODER.encode(plan)


def decode(data: bytes) -> StepPlan:
    return _DECODER.decode(data)


class Executor:
    """One backend's sessions by id, and the one place a plan's effects are run (and recorded)."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.sessions: dict[int, Session] = {}
        self.ops: list[Op] = []  # run since the last plan took them
        self.seconds = 0.0  # spent in the backend
        self._next_sid = 0

    def new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid

    def take_ops(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops

    def run(self, op: Op) -> Any:
        """Run one op; it is recorded only if it did not raise. Returns what Export exports."""
        t0, result = time.perf_counter(), None
        try:
            match op:
                case Open(sid=sid):
                    self.sessions[sid] = self.backend.open_session()
                case Clone(sid=sid, source=source, upto=upto):
                    self.sessions[sid] = self.backend.clone(self.sessions[source], upto)
                case Import(sid=sid, state=state):
                    self.sessions[sid] = self.backend.import_state(state)
                case Export(sid=sid):
                    result = self.backend.export_state(self.sessions[sid])
                case KeepAt(sid=sid, positions=positions):
                    self.backend.keep_at(self.sessions[sid], positions)
                case MoveCheckpoints(source=source, target=target):
                    self.backend.move_checkpoints(self.sessions[source], self.sessions[target])
                case Release(sids=sids):
                    for sid in sids:
                        session = self.sessions.pop(sid, None)
                        if session is not None:  # releasing twice is a no-op (Backend.release)
                            self.backend.release(session)
        finally:
            self.seconds += time.perf_counter() - t0
        self.ops.append(op)
        return result

    def forward(self, rows: Sequence[Row]) -> Any:
        """One forward pass over `rows`: one `prefill` call when any row is a prefill chunk (with the
        decode rows, on a mixed_batches backend), else one `decode` call."""
        t0 = time.perf_counter()
        try:
            sessions = [self.sessions[row.sid] for row in rows]
            if any(row.prefill for row in rows):
                return self.backend.prefill(sessions, [row.tokens for row in rows])
            return self.backend.decode(sessions, [row.tokens[0] for row in rows])
        finally:
            self.seconds += time.perf_counter() - t0

    def sample(self, logits: Any, states: Sequence[SamplerState]) -> Any:
        t0 = time.perf_counter()
        try:
            return self.backend.sample(logits, states)
        finally:
            self.seconds += time.perf_counter() - t0


_DISCARD = SamplingParams()  # greedy: samples the logits rows nobody reads, leaving real streams untouched


def replay(plans: Sequence[StepPlan], backend: Backend) -> dict[int, list[int]]:
    """Run recorded plans on `backend` (loaded, holding no session of theirs); the tokens each
    request's sampler picks, by rid."""
    ex = Executor(backend)
    samplers: dict[int, SamplerState] = {}
    picked: dict[int, list[int]] = {}
    for plan in plans:
        for op in plan.ops:
            ex.run(op)
        for s in plan.samplers:
            samplers[s.rid] = SamplerState(s.params, prompt=s.prompt)
        for rows in plan.passes():
            logits = ex.forward(rows)
            at = {row.rid: i for i, row in enumerate(rows)}
            for s in plan.samples:
                if s.row in at:
                    states = [samplers[s.rid] if i == at[s.row] else SamplerState(_DISCARD) for i in range(len(rows))]
                    picked.setdefault(s.rid, []).append(ex.sample(logits, states)[at[s.row]].token)
    return picked
