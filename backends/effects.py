"""Backend effects as plain values, and the one place they run.

    Op        a session effect: Open, Clone, Import, Export, KeepAt, MoveCheckpoints, Truncate, Release
    Pass      a forward pass: Prefill (chunks, decode rows among them on a mixed_batches backend),
              Verify (the same, reading a decode row's drafted positions too) or Decode (one token a row)
    Executor  one backend's sessions by id, and `run(effect)`: the one place an effect becomes
              a backend call
    encode(value) -> bytes, decoder(kind)(data) -> value     msgpack through msgspec

Both plans are built of these values: the engine's step plan (server/engine/worker/plan.py: a step's
ops, then its rows) and what rank 0 sends every other rank of one model (backends/lockstep:
each effect its backend ran, in order), which each rank runs through its own Executor.

Design rules:
- sessions are named by ids (`sid`) that whoever builds the effects hands out, never by
  object, so a list of effects runs from itself alone: on a fresh backend, or on another rank;
- an effect is kept once it ran: one that raised changed nothing (a refused clone, a
  check_inputs refusal) and is in no plan;
- what crosses is msgspec values only: tagged structs, ints, strings, lists, and a saved
  state's arrays as dtype, shape and bytes (numbers only); no pickled object, so a decoder
  builds nothing its schema does not name.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence, TypeVar

import msgspec
import numpy as np

from kvfork.backends.base import Backend, SamplerState, SavedState, Session

T = TypeVar("T")


class Open(msgspec.Struct, tag="open", frozen=True):
    sid: int  # an empty session


class Clone(msgspec.Struct, tag="clone", frozen=True):
    sid: int  # a new session holding [0, upto) of `source` (Backend.clone)
    source: int
    upto: int


class Import(msgspec.Struct, tag="import", frozen=True):
    sid: int  # a new session holding a saved state (the disk tier's; on a rank, its shard of it)
    state: SavedState


class Export(msgspec.Struct, tag="export", frozen=True):
    sid: int  # its state to the host (the disk tier); the session is unchanged


class KeepAt(msgspec.Struct, tag="keep_at", frozen=True):
    sid: int  # keep the recurrent state at these positions (Backend.keep_at)
    positions: tuple[int, ...]


class MoveCheckpoints(msgspec.Struct, tag="move_checkpoints", frozen=True):
    source: int
    target: int


class Truncate(msgspec.Struct, tag="truncate", frozen=True):
    sid: int  # roll back to `position` (Backend.truncate): drafted tokens past the accepted run, or a named
    # session that stopped inside an image back to its first token
    position: int


class Release(msgspec.Struct, tag="release", frozen=True):
    sids: list[int]  # a request's sessions leave together


class Prefill(msgspec.Struct, tag="prefill", frozen=True):
    sids: list[int]  # chunks[i] committed to sids[i] (Backend.prefill)
    chunks: list[list[int]]


class Verify(msgspec.Struct, tag="verify", frozen=True):
    sids: list[int]  # chunks[i] committed to sids[i], its last reads[i] positions' logits read (Backend.verify)
    chunks: list[list[int]]
    reads: list[int]


class Decode(msgspec.Struct, tag="decode", frozen=True):
    sids: list[int]  # tokens[i] committed to sids[i] (Backend.decode)
    tokens: list[int]


Op = Open | Clone | Import | Export | KeepAt | MoveCheckpoints | Truncate | Release
Pass = Prefill | Verify | Decode
Effect = Op | Pass


class Executor:
    """One backend's sessions by id, and the one place an effect is run."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.sessions: dict[int, Session] = {}
        self.seconds = 0.0  # spent in the backend
        self._next_sid = 0

    def new_sid(self) -> int:
        self._next_sid += 1
        return self._next_sid

    def run(self, effect: Effect) -> Any:
        """Run one effect. Returns a pass's logits, and the state an Export exports."""
        b, s = self.backend, self.sessions
        t0 = time.perf_counter()
        try:
            match effect:
                case Open(sid=sid):
                    s[sid] = b.open_session()
                case Clone(sid=sid, source=source, upto=upto):
                    s[sid] = b.clone(s[source], upto)
                case Import(sid=sid, state=state):
                    s[sid] = b.import_state(state)
                case Export(sid=sid):
                    return b.export_state(s[sid])
                case KeepAt(sid=sid, positions=positions):
                    b.keep_at(s[sid], positions)
                case MoveCheckpoints(source=source, target=target):
                    b.move_checkpoints(s[source], s[target])
                case Truncate(sid=sid, position=position):
                    b.truncate(s[sid], position)
                case Release(sids=sids):
                    for sid in sids:
                        session = s.pop(sid, None)
                        if session is not None:  # releasing twice is a no-op (Backend.release)
                            b.release(session)
                case Prefill(sids=sids, chunks=chunks):
                    return b.prefill([s[sid] for sid in sids], chunks)
                case Verify(sids=sids, chunks=chunks, reads=reads):
                    return b.verify([s[sid] for sid in sids], chunks, reads)
                case Decode(sids=sids, tokens=tokens):
                    return b.decode([s[sid] for sid in sids], tokens)
                case other:
                    raise TypeError(f"not a backend effect: {other!r}")
            return None
        finally:
            self.seconds += time.perf_counter() - t0

    def sample(self, logits: Any, states: Sequence[SamplerState], rows: Sequence[int]) -> Any:
        """States[i] samples logits row rows[i]; no other row is sampled (Backend.select_rows)."""
        t0 = time.perf_counter()
        try:
            return self.backend.sample(self.backend.select_rows(logits, rows), states)
        finally:
            self.seconds += time.perf_counter() - t0


class _Array(msgspec.Struct, frozen=True):
    """A saved state's array as it crosses."""

    dtype: str
    shape: list[int]
    data: bytes


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _Array(obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes())
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        array = msgspec.convert(obj, _Array)
        dtype = np.dtype(array.dtype)
        if dtype.kind not in "biuf":
            raise ValueError(f"a saved state holds numbers, not {dtype}")
        return np.frombuffer(array.data, dtype=dtype).reshape(array.shape).copy()
    raise NotImplementedError(f"cannot decode {kind.__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(value: msgspec.Struct) -> bytes:
    """A plan as msgpack, saved states' arrays included."""
    return _ENCODER.encode(value)


def decoder(kind: type[T]) -> Callable[[bytes], T]:
    """Reads what `encode` wrote as a `kind`; anything else raises msgspec.ValidationError."""
    return msgspec.msgpack.Decoder(kind, dec_hook=_dec_hook).decode
