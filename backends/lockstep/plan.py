"""The plan rank 0 sends every other rank: each backend effect, in order, as plain msgspec values.

Rank 0 runs the engine; its backend (leader.py) records every call that changes state as an
effect, and before each call that runs collectives (prefill, decode, export, import) sends the
effects recorded since the last one as one `Plan`. Every other rank (follower.py) applies them to
its own backend, on its own shard of each session, so a clone, a checkpoint or a release happens
on every rank at once. Sampled tokens reach the other ranks as the next plan's decode rows.

Sessions are named by ids that rank 0 hands out (`sid`, as issue 24's step plan names them), the same
on every rank. Nothing
but msgspec values (ints, strings, lists, tagged structs) crosses: no pickled Python object, so a
rank never runs code another one sent.
"""

from __future__ import annotations

from typing import Union

import msgspec


class Load(msgspec.Struct, tag="load", frozen=True):
    """Load the model: rank 0's settings bind every rank."""

    folder: str
    dtype: str | None
    clone_mode: str


class Open(msgspec.Struct, tag="open", frozen=True):
    sid: int


class Clone(msgspec.Struct, tag="clone", frozen=True):
    """`sid` becomes a clone of [0, upto) of `source` (rank 0's clone succeeded: so does every rank's)."""

    sid: int
    source: int
    upto: int


class Prefill(msgspec.Struct, tag="prefill", frozen=True):
    """One forward pass: chunks[i] committed to sids[i] (decode rows are one-token chunks on torch)."""

    sids: list[int]
    chunks: list[list[int]]


class Decode(msgspec.Struct, tag="decode", frozen=True):
    """One batched decode step: tokens[i] (rank 0 sampled it) committed to sids[i]."""

    sids: list[int]
    tokens: list[int]


class Release(msgspec.Struct, tag="release", frozen=True):
    sids: list[int]


class KeepAt(msgspec.Struct, tag="keep_at", frozen=True):
    sid: int
    positions: list[int]


class MoveCheckpoints(msgspec.Struct, tag="move_checkpoints", frozen=True):
    source: int
    target: int


class Export(msgspec.Struct, tag="export", frozen=True):
    """Every rank exports its shard of the session's state, and rank 0 gathers them (channel.gather)."""

    sid: int


class ArraySpec(msgspec.Struct, frozen=True):
    """One saved array as it crosses: the whole array's shape (split on axis 0 over the ranks) and dtype."""

    shape: list[int]
    dtype: str


class LayerSpec(msgspec.Struct, frozen=True):
    kind: str
    first: int
    arrays: list[ArraySpec]


class Import(msgspec.Struct, tag="import", frozen=True):
    """`sid` becomes a session holding the saved state described here, whose arrays rank 0 sends next
    (channel.broadcast_buffer); each rank keeps its part of axis 0."""

    sid: int
    position: int
    layers: list[LayerSpec]


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """Rank 0 is shutting down: every rank leaves."""

    reason: str


Effect = Union[Load, Open, Clone, Prefill, Decode, Release, KeepAt, MoveCheckpoints, Export, Import, Stop]


class Plan(msgspec.Struct, frozen=True):
    """The effects since the previous plan, in order; `step` counts plans, so a rank that missed one knows."""

    step: int
    effects: list[Effect]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Plan)


def encode(plan: Plan) -> bytes:
    return _encoder.encode(plan)


def decode(payload: bytes) -> Plan:
    return _decoder.decode(payload)
