"""What rank 0 sends every other rank: each backend effect its backend ran, in order, as plain msgspec
values (backends/effects.py, the vocabulary of the engine's step plan too), and the two that only
ranks need: Load and Stop.

Rank 0's backend (leader.py) records every call that changes state as an effect, and before each
call that runs collectives (a forward pass, an export, an import) sends the effects recorded since
the last one, itself last, as one `Broadcast`. Every other rank (follower.py) runs them through its
own Executor, on its own shard of each session, so a clone, a checkpoint or a release happens on
every rank at once. Sampled tokens reach the other ranks as the next Decode's tokens.

Sessions are named by rank 0's session ids (`sid`: Session.id), the same on every rank. An
Import carries the whole saved state (its arrays as numbers); each rank keeps its part of it.
"""

from __future__ import annotations

import msgspec

from kvfork.backends import effects
from kvfork.backends.effects import Effect


class Load(msgspec.Struct, tag="load", frozen=True):
    """Load the model: rank 0's settings bind every rank."""

    folder: str
    dtype: str | None
    clone_mode: str
    kv_cache_dtype: str = "auto"
    kv_group_size: int = 64


class Stop(msgspec.Struct, tag="stop", frozen=True):
    """Rank 0 is shutting down: every rank leaves."""

    reason: str


class Broadcast(msgspec.Struct, frozen=True):
    """The effects since the previous broadcast, in order; `seq` counts broadcasts, so a rank that
    missed one knows."""

    seq: int
    effects: list[Effect | Load | Stop]


_decode = effects.decoder(Broadcast)


def encode(broadcast: Broadcast) -> bytes:
    return effects.encode(broadcast)


def decode(payload: bytes) -> Broadcast:
    return _decode(payload)
