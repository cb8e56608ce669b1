"""How rank 0 reaches the other ranks: its effects (wire.py), and the shards of exported states,
over the collective library the model runs on (torch.distributed or mx.distributed), never a
transport of our own.

Three verbs, every rank calling each one at the same point of the effects it runs:
- `broadcast(payload)`: rank 0's bytes to every rank (a broadcast of effects);
- `all_ok(ok)`: whether every rank's part of an optional step (an export, an import) went well;
- `gather(buffer)`: each rank's bytes, to rank 0 (the shards of an exported state).

A payload travels in one collective of `HEAD` bytes (its length, then its first bytes) and, when it
is longer, a second one for the rest: a decode step's is a few hundred bytes, an import's holds the
whole saved state.
"""

from __future__ import annotations

import abc
import struct
from typing import Any

import numpy as np

HEAD = 4096  # bytes of the first collective of a payload: a decode step of 64 rows fits in it


class Channel(abc.ABC):
    rank: int
    size: int

    def broadcast(self, payload: bytes | None) -> bytes:
        """Rank 0's `payload` (None on the other ranks), on every rank."""
        head = np.zeros(HEAD, np.uint8)
        if payload is not None:
            first = payload[: HEAD - 8]
            head[:8] = np.frombuffer(struct.pack("<Q", len(payload)), np.uint8)
            head[8:8 + len(first)] = np.frombuffer(first, np.uint8)
        head = self._broadcast(head)
        (length,) = struct.unpack("<Q", head[:8].tobytes())
        if length <= HEAD - 8:
            return head[8:8 + length].tobytes()
        rest = np.zeros(length - (HEAD - 8), np.uint8)
        if payload is not None:
            rest[:] = np.frombuffer(payload, np.uint8, offset=HEAD - 8)
        return head[8:].tobytes() + self._broadcast(rest).tobytes()

    @abc.abstractmethod
    def all_ok(self, ok: bool) -> bool:
        """True on every rank when `ok` was True on every rank."""

    @abc.abstractmethod
    def gather(self, buffer: np.ndarray) -> list[np.ndarray] | None:
        """Every rank's `buffer` (uint8, the same length on each), in rank order, on rank 0; None elsewhere."""

    @abc.abstractmethod
    def _broadcast(self, buffer: np.ndarray) -> np.ndarray:
        """Rank 0's uint8 `buffer` on every rank (the others pass one of the same length)."""


class TorchChannel(Channel):
    """Over a gloo process group (also beside NCCL: plans and states are host bytes)."""

    def __init__(self, group: Any):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _broadcast(self, buffer: np.ndarray) -> np.ndarray:
        import torch

        tensor = torch.from_numpy(np.ascontiguousarray(buffer))
        self.dist.broadcast(tensor, 0, group=self.group)
        return tensor.numpy()

    def all_ok(self, ok: bool) -> bool:
        import torch

        failed = torch.tensor([0 if ok else 1], dtype=torch.int32)
        self.dist.all_reduce(failed, group=self.group)
        return int(failed) == 0

    def gather(self, buffer: np.ndarray) -> list[np.ndarray] | None:
        import torch

        tensor = torch.from_numpy(np.ascontiguousarray(buffer))
        parts = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        self.dist.gather(tensor, parts, dst=0, group=self.group)
        return None if parts is None else [p.numpy() for p in parts]


class MLXChannel(Channel):
    """Over an mx.distributed group (ring, JACCL, MPI), on the CPU stream. mx.distributed has no
    broadcast: rank 0's bytes are an all_sum to which the other ranks add zeros."""

    def __init__(self, group: Any):
        import mlx.core as mx

        self.mx, self.group = mx, group
        self.rank, self.size = group.rank(), group.size()

    def _run(self, op: Any, buffer: np.ndarray) -> np.ndarray:
        out = op(self.mx.array(buffer), group=self.group, stream=self.mx.cpu)
        self.mx.eval(out)
        return np.array(out)

    def _broadcast(self, buffer: np.ndarray) -> np.ndarray:
        return self._run(self.mx.distributed.all_sum, buffer)

    def all_ok(self, ok: bool) -> bool:
        return int(self._run(self.mx.distributed.all_sum, np.array([0 if ok else 1], np.int32))[0]) == 0

    def gather(self, buffer: np.ndarray) -> list[np.ndarray] | None:
        everything = self._run(self.mx.distributed.all_gather, buffer)
        return list(np.split(everything, self.size)) if self.rank == 0 else None
