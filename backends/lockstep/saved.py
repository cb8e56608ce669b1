"""Saved states (the saved-state rule, base.SavedState) across ranks: each rank holds its shard of
every array on axis 0 (the KV heads of a layer's keys and values; a recurrent layer's state arrays
as its model splits them). An exported state is every rank's shard, gathered as one byte buffer a
rank; an imported one crosses whole (in the Import effect) and each rank keeps its part.

Joined on axis 0, the shards of keys and values are the one-process layout (heads split in order);
a recurrent array is joined rank by rank, which only a run of as many ranks splits back the same
way, so the disk tier names states by the rank count too (LockstepBackend.state_format).
"""

from __future__ import annotations

import numpy as np

from kvfork.backends.base import SavedLayer, SavedState


def to_bytes(state: SavedState) -> np.ndarray:
    """Every array of the state, in layer order, as one uint8 buffer."""
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for layer in state.layers for a in layer.arrays]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def from_bytes(like: SavedState, buffer: np.ndarray) -> SavedState:
    """The state `to_bytes` wrote into `buffer`, whose arrays have the shapes and dtypes of `like`'s
    (every rank's shard has the same)."""
    layers, at = [], 0
    for layer in like.layers:
        arrays = []
        for a in layer.arrays:
            arrays.append(buffer[at:at + a.nbytes].view(a.dtype).reshape(a.shape))
            at += a.nbytes
        layers.append(SavedLayer(layer.kind, tuple(arrays), layer.first))
    return SavedState(like.position, tuple(layers), like.rope_shifts)


def join(shards: list[SavedState]) -> SavedState:
    """The whole state from every rank's shard, in rank order."""
    first = shards[0]
    layers = tuple(SavedLayer(layer.kind, tuple(np.concatenate(parts, axis=0) for parts in
                                                zip(*(s.layers[i].arrays for s in shards))), layer.first)
                   for i, layer in enumerate(first.layers))
    return SavedState(first.position, layers, first.rope_shifts)


def shard(state: SavedState, rank: int, size: int) -> SavedState:
    """Rank `rank`'s part of a whole state: axis 0 of every array split in `size`."""
    layers = tuple(SavedLayer(layer.kind, tuple(np.ascontiguousarray(np.split(a, size)[rank]) for a in layer.arrays),
                              layer.first) for layer in state.layers)
    return SavedState(state.position, layers, state.rope_shifts)
