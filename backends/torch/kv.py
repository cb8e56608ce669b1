"""Per-session KV state: one contiguous buffer per full layer, one ring per sliding layer.

Design rules:
- Head-major: a full layer's buffer is [kv_heads, capacity, head_dim], and
  attention reads the prefix view [:, :end] as it is (no copy per step). Each
  head's keys are one contiguous run. Measured with tools/decode_bench.py
  (`layout` section): torch's CPU SDPA decodes over this 1.5-2.5x faster than
  over token-major [capacity, kv_heads, head_dim] transposed to heads first,
  and FlashAttention reads it on CUDA through strides (batch, token, head).
- Block-addressable: capacity is a whole number of `BLOCK_TOKENS` blocks, and
  block i of a layer is `[:, i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]`. A session
  of n tokens holds `capacity(n)` tokens per full layer, always one slot more
  than n at least, so a clone or a decode step does not reallocate; a write that
  reaches the capacity grows the buffer to `capacity(end)` (one copy per block).
  Contiguous, not a pool of blocks with a block table: on the CPU every varlen
  attention over scattered blocks needs a gather, which costs more than the
  attention itself (the `layout` section measures it), and torch has no paged
  kernel there.
- A sliding layer of window W is a ring of W slots; position p lives in slot
  p % W. `held_from` is the oldest position whose slot is still valid. That is
  what base.clone_refusal judges.
- A write past `position` into a growing buffer is invisible (reads stop at the
  writer's end, the next write overwrites it); a ring write replaces positions
  still read. So a failed call leaves a session untouched exactly when none of
  its rings was written (`ring_writes` counts them).
- Every copy (growth, clone) writes new tensors. No two sessions ever share one.

Cost of a session of n tokens, exactly (what `layers_bytes` returns):
  full layers x 2 x kv_heads x head_dim x itemsize x capacity(n)
  + sliding layers x 2 x kv_heads x head_dim x itemsize x window.
"""

from __future__ import annotations

import torch

BLOCK_TOKENS = 256  # tokens per block of a full layer's buffer: its unit of growth and of address


def capacity(tokens: int) -> int:
    """Slots a full layer holds for a session of `tokens` tokens: whole blocks, at least one free slot."""
    return (tokens // BLOCK_TOKENS + 1) * BLOCK_TOKENS


class GrowingKV:
    """A full-attention layer: keys/values for positions [0, position) at the front of a buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    @classmethod
    def empty(cls, kv_heads: int, head_dim: int, tokens: int, dtype, device) -> GrowingKV:
        shape = (kv_heads, capacity(tokens), head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def reserve(self, end: int) -> None:
        """Room for writes up to `end` (exclusive), keeping what is held."""
        held = self.keys.shape[1]
        if end < held:
            return
        grown = GrowingKV.empty(self.keys.shape[0], self.keys.shape[2], end, self.keys.dtype, self.keys.device)
        grown.keys[:, :held].copy_(self.keys)
        grown.values[:, :held].copy_(self.values)
        self.keys, self.values = grown.keys, grown.values

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Write k, v ([kv_heads, n, head_dim]) at [start, start + n); return all keys, values and
        the first key position (always 0: keys are in position order)."""
        end = start + k.shape[1]
        self.reserve(end)
        self.keys[:, start:end].copy_(k)
        self.values[:, start:end].copy_(v)
        return self.keys[:, :end], self.values[:, :end], 0

    def copy_prefix(self, upto: int) -> GrowingKV:
        copy = GrowingKV.empty(self.keys.shape[0], self.keys.shape[2], upto, self.keys.dtype, self.keys.device)
        copy.keys[:, :upto].copy_(self.keys[:, :upto], non_blocking=True)
        copy.values[:, :upto].copy_(self.values[:, :upto], non_blocking=True)
        return copy

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values


class RingKV:
    """A sliding-window layer: the last `window` positions, position p in slot p % window."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, held_from: int = 0):
        self.keys, self.values = keys, values
        self.held_from = held_from
        self.writes = 0

    @classmethod
    def empty(cls, kv_heads: int, head_dim: int, window: int, dtype, device) -> RingKV:
        shape = (kv_heads, window, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    @property
    def window(self) -> int:
        return self.keys.shape[1]

    def reserve(self, end: int) -> None:
        """A ring never grows."""

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """Write k, v ([kv_heads, n, head_dim]) at [start, start + n); return the keys the new
        queries may attend.

        One token (decode): the ring itself after the write, slots unordered but
        all inside the window; first position None means "no mask needed".
        A chunk: the held positions the chunk's first query still sees, in order,
        followed by the chunk (the ring transiently holds more than W, never less).
        """
        n, w = k.shape[1], self.window
        end = start + n
        if n == 1:
            self._write(k, v, start)
            filled = min(end, w)
            return self.keys[:, :filled], self.values[:, :filled], None
        first = max(self.held_from, start - w + 1)
        slots = torch.arange(first, start, device=k.device) % w
        keys = torch.cat((self.keys[:, slots], k), dim=1)
        values = torch.cat((self.values[:, slots], v), dim=1)
        keep = min(n, w)
        self._write(k[:, n - keep :], v[:, n - keep :], end - keep)
        return keys, values, first

    def _write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        slots = torch.arange(start, start + k.shape[1], device=k.device) % self.window
        self.writes += 1  # before the first byte moves: a write that fails midway still counts
        self.keys[:, slots] = k
        self.values[:, slots] = v
        self.held_from = max(self.held_from, start + k.shape[1] - self.window)

    def copy_prefix(self, upto: int) -> RingKV:
        # clone_refusal admits upto >= position - 1 once the ring has wrapped, so the copy
        # holds what the donor holds. Slot upto % W may carry the donor's position `upto`:
        # the clone's next write replaces it before anything reads it.
        return RingKV(self.keys.clone(), self.values.clone(), self.held_from)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values


LayerKV = GrowingKV | RingKV


def new_layers(windows: tuple[int | None, ...], kv_heads: int, head_dim: int, dtype, device) -> list[LayerKV]:
    return [
        RingKV.empty(kv_heads, head_dim, w, dtype, device) if w else GrowingKV.empty(kv_heads, head_dim, 0, dtype, device)
        for w in windows
    ]


def copy_layers(layers: list[LayerKV], upto: int) -> list[LayerKV]:
    return [layer.copy_prefix(upto) for layer in layers]


def reserve(layers: list[LayerKV], end: int) -> None:
    """Grow every full layer for writes up to `end`, before a forward pass writes any of them."""
    for layer in layers:
        layer.reserve(end)


def held_from(layers: list[LayerKV]) -> list[int]:
    """Oldest held position of each sliding layer, in layer order (base.clone_refusal's argument)."""
    return [layer.held_from for layer in layers if isinstance(layer, RingKV)]


def ring_writes(layers: list[LayerKV]) -> int:
    return sum(layer.writes for layer in layers if isinstance(layer, RingKV))


def layers_bytes(layers: list[LayerKV]) -> int:
    return sum(t.numel() * t.element_size() for layer in layers for t in layer.tensors())
