"""Per-session KV state: full layers in refcounted runs of blocks, one ring per sliding layer.

Design rules:
- Head-major: a full layer's keys are [kv_heads, tokens, head_dim] and attention
  reads views of them as they are (no copy per step). Each head's keys are one
  contiguous run. Measured with tools/decode_bench.py (`layout` section): torch's
  CPU SDPA decodes over this 1.5-2.5x faster than over token-major
  [capacity, kv_heads, head_dim], and FlashAttention reads it through strides.
- Blocks: a full layer's positions come in blocks of `BLOCK_TOKENS`. A `Store` is a
  run of whole blocks [base, base + capacity) of every full layer, one tensor pair
  per layer, written by one session (its writer) only. Block i of a store is
  (store.id, i): its identity, which the budget, the metrics and a later disk tier
  index by.
- A session (`BlockTable`) reads, in position order, runs of stores it shares
  (positions [store.base, end) of each) and writes its own store after them.
  Attention reads each run as one view: a session that never shared anything has
  one run, one contiguous buffer; a clone has two or three.
- Clone by reference (`share`): a clone at `upto` reads the donor's full blocks
  below `floor(upto)` where they lie, and copies only the partial block
  [floor(upto), upto) into its own one-block store: at most one block per layer.
  Nobody ever writes a block someone else reads: a store's readers read below the
  writer's position at the clone, and the writer writes at or past its position.
- Growth: a session of n tokens holds `capacity(n)` positions of its own (whole
  blocks, one position always free), so a clone or a decode step does not reallocate.
  A write past the own store grows it by one copy, unless someone reads it: then
  it is frozen as it is and a new store takes the positions after it, so a shared
  store is never copied nor moved.
- Lifetime: a store is freed when its writer has released it and no reader is
  left (reference counts are its holders: the writer while alive, and each
  reader). A store whose writer is gone and that others still read is "pooled":
  held by no one session, counted once (`BlockPool.pooled_bytes`).
- `copy` mode clones by copying (for measurements side by side against `share`):
  the clone writes a store of its own holding all of [0, upto).
- A sliding layer of window W is a ring of W entries; position p lives in entry
  p % W. `held_from` is the oldest position whose entry is still valid. That is
  what base.clone_refusal judges. Rings (and recurrent states) stay copied.
- Storage (--kv-cache-dtype, kv_storage.py): every tensor here holds rows as its storage writes
  them, [kv_heads, tokens, width]; attention encodes what a pass computes (keys rotated where the storage
  rotates them, `Storage.encode_kv`), `FullKV.update` and `RingKV.update` write those rows and return
  stored runs, which attention decodes (attention.py).
  Clones, rings' undo and saved states move the stored rows as they are.
- A write past `position` into a store is invisible (reads stop at the writer's
  end, the next write overwrites it); a ring write replaces positions still
  read. So a failed call leaves a session untouched exactly when none of its
  rings was written (`ring_writes` counts them).

Cost of a session of n tokens opened at `start` with `shared` leading tokens read
by reference (exactly what `BlockTable.owned_bytes` returns, KVCost.bytes_for):
  (capacity(n) - shared) x full layers x 2 x kv_heads x row bytes
  + sliding layers x 2 x kv_heads x row bytes x window,
a row being one head's token as stored (kv_storage.row_bytes: head_dim x itemsize when plain).
"""

from __future__ import annotations

import itertools
import math
import mmap
from typing import Literal, Sequence

import torch

from kvfork.backends.base import BlockStats
from kvfork.backends.torch.kv_storage import Storage, row_bytes

BLOCK_TOKENS = 256  # tokens per block: the unit of growth, of sharing and of address (docs/benchmarks.md)
# Positions a decode row reads, and a prefill chunk decodes, in one piece where the storage is not the weights'
# dtype (attention.py): the float32 copy of torch's products (working memory, kv_storage.working_memory) stays
# bounded (3 MB at the default model's 3 key heads of 64), and fewer, larger pieces measured faster than blocks
# of 256, whose per-call costs dominated (docs/benchmarks.md, "KV storage")
PIECE_TOKENS = 16 * BLOCK_TOKENS

CloneMode = Literal["share", "copy"]


def state_memory(shape: Sequence[int], dtype: torch.dtype, device, zeroed: bool = False) -> torch.Tensor:
    """A buffer of session state (KV stores, rings, recurrent states). On the CPU each is its own
    anonymous mapping, handed back to the system the moment it is freed. Through malloc, glibc raises
    its mmap threshold after the first large free, so later buffers of other sizes come from its heap
    and fragment it: over 600 clone / release cycles on the default model, RSS grew 224 MiB beyond the
    KV held that way, 33 MiB this way (docs/benchmarks.md). A new mapping reads as zeros."""
    count = math.prod(shape)
    if torch.device(device).type != "cpu" or count == 0:
        return (torch.zeros if zeroed else torch.empty)(tuple(shape), dtype=dtype, device=device)
    mapping = mmap.mmap(-1, count * dtype.itemsize)
    return torch.frombuffer(mapping, dtype=dtype, count=count).view(tuple(shape))  # the tensor keeps it alive


def state_copy(tensor: torch.Tensor) -> torch.Tensor:
    return state_memory(tensor.shape, tensor.dtype, tensor.device).copy_(tensor)


Segments = list[tuple[torch.Tensor, torch.Tensor]]  # (keys, values) stored views, in position order


def capacity(tokens: int) -> int:
    """Positions a session of `tokens` tokens holds: whole blocks, at least one free position."""
    return (tokens // BLOCK_TOKENS + 1) * BLOCK_TOKENS


def floor_block(tokens: int) -> int:
    """The positions of the whole blocks below `tokens`: what a clone there shares."""
    return tokens // BLOCK_TOKENS * BLOCK_TOKENS


class Store:
    """Blocks [base, base + capacity) of every full layer, written by one session."""

    _ids = itertools.count(1)

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], base: int, capacity: int, writer: int):
        self.id = next(Store._ids)
        self.keys, self.values, self.base, self.capacity = keys, values, base, capacity
        self.writer: int | None = writer  # the session that writes it; None once it released it
        self.readers: dict[int, int] = {}  # session id -> end: it reads [base, end)
        self.nbytes = sum(t.numel() * t.element_size() for t in (*keys, *values))

    @property
    def end(self) -> int:
        return self.base + self.capacity

    def block_refs(self) -> list[int]:
        """Holders of each block: the writer (all of them), and each reader below its end."""
        refs = [int(self.writer is not None)] * (self.capacity // BLOCK_TOKENS)
        for end in self.readers.values():
            for i in range((end - self.base) // BLOCK_TOKENS):
                refs[i] += 1
        return refs


class BlockPool:
    """Every store of one backend: allocation, reference counts and accounting."""

    def __init__(self, full_layers: int, kv_heads: int, head_dim: int, storage: Storage, device):
        self.full_layers, self.kv_heads, self.head_dim = full_layers, kv_heads, head_dim
        self.storage, self.device = storage, device
        self.stores: dict[int, Store] = {}

    def new_store(self, base: int, tokens: int, writer: int) -> Store:
        shape = (self.kv_heads, tokens, self.storage.width(self.head_dim))
        made = [state_memory(shape, self.storage.dtype, self.device) for _ in range(2 * self.full_layers)]
        store = Store(made[: self.full_layers], made[self.full_layers :], base, tokens, writer)
        self.stores[store.id] = store
        return store

    def drop_if_unheld(self, store: Store) -> None:
        if store.writer is None and not store.readers:
            self.stores.pop(store.id, None)

    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.stores.values())

    def pooled_bytes(self) -> int:
        """Stores whose writer is gone that others still read: held by no one session."""
        return sum(s.nbytes for s in self.stores.values() if s.writer is None)

    def stats(self) -> BlockStats:
        refs = [r for s in self.stores.values() for r in s.block_refs()]
        return BlockStats(len(refs), sum(1 for r in refs if r > 1), sum(max(0, r - 1) for r in refs) * self.block_bytes)

    @property
    def block_bytes(self) -> int:
        return 2 * self.full_layers * self.kv_heads * BLOCK_TOKENS * row_bytes(self.storage, self.head_dim)


class BlockTable:
    """One session's full-attention KV: the runs it reads, then the store it writes."""

    def __init__(self, pool: BlockPool, session: int, reads: list[tuple[Store, int]], own: Store):
        self.pool, self.session = pool, session
        self.reads = reads  # (store, end): positions [store.base, end), in order, ending at own.base
        self.own = own

    @classmethod
    def empty(cls, pool: BlockPool, session: int, tokens: int = 0) -> BlockTable:
        return cls(pool, session, [], pool.new_store(0, capacity(tokens), session))

    def runs(self) -> list[tuple[Store, int]]:
        return [*self.reads, (self.own, self.own.end)]

    def reserve(self, end: int) -> None:
        """Room for writes up to `end` (exclusive), keeping what is held."""
        own = self.own
        if end < own.end:
            return
        if own.readers:  # read by others: frozen where it lies, a new store takes the positions after it
            self.reads.append((own, own.end))
            self.own = self.pool.new_store(own.end, capacity(end) - own.end, self.session)
            return
        grown = self.pool.new_store(own.base, capacity(end) - own.base, self.session)
        for old, new in zip((*own.keys, *own.values), (*grown.keys, *grown.values)):
            new[:, : own.capacity].copy_(old)
        own.writer = None
        self.pool.drop_if_unheld(own)
        self.own = grown

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> Segments:
        """Write stored rows k, v ([kv_heads, n, width]) at [start, start + n) of full layer `layer`;
        return the stored runs of keys and values [0, start + n), in position order."""
        end = start + k.shape[1]
        out = []
        for store, stop in self.runs():
            hi = min(stop, end)
            if hi <= store.base:
                break
            lo = max(start, store.base)
            if lo < hi:  # only ever a store this session writes, at or past its position
                assert store.writer == self.session, "a session wrote a block it only reads"
                store.keys[layer][:, lo - store.base : hi - store.base].copy_(k[:, lo - start : hi - start])
                store.values[layer][:, lo - store.base : hi - store.base].copy_(v[:, lo - start : hi - start])
            out.append((store.keys[layer][:, : hi - store.base], store.values[layer][:, : hi - store.base]))
        return out

    def clone(self, session: int, upto: int, mode: CloneMode) -> BlockTable:
        """A table holding [0, upto) for `session`: sharing the whole blocks below `upto` (mode share)
        and copying the rest into a store of its own."""
        shared = floor_block(upto) if mode == "share" else 0
        reads = [(store, min(stop, shared)) for store, stop in self.runs() if store.base < shared]
        own = self.pool.new_store(shared, capacity(upto) - shared, session)
        try:
            for store, stop in self.runs():
                lo, hi = max(shared, store.base), min(stop, upto)
                if lo < hi:
                    for src, dst in zip((*store.keys, *store.values), (*own.keys, *own.values)):
                        dst[:, lo - shared : hi - shared].copy_(src[:, lo - store.base : hi - store.base],
                                                               non_blocking=True)
        except BaseException:
            own.writer = None
            self.pool.drop_if_unheld(own)
            raise
        for store, end in reads:  # nothing can fail from here: the references are taken last
            store.readers[session] = end
        return BlockTable(self.pool, session, reads, own)

    def release(self) -> None:
        for store, _ in self.runs():
            if store.writer == self.session:
                store.writer = None
            else:
                store.readers.pop(self.session, None)
            self.pool.drop_if_unheld(store)
        self.reads = []

    def owned_bytes(self) -> int:
        """Bytes of the stores this session writes (frozen ones too): what it costs on its own."""
        return sum(store.nbytes for store, _ in self.runs() if store.writer == self.session)

    def frees_bytes(self) -> int:
        """Bytes its release would free now: what it writes that nobody reads, and the pooled stores
        it alone still reads."""
        return sum(store.nbytes for store, _ in self.runs()
                   if (store.writer == self.session and not store.readers)
                   or (store.writer is None and set(store.readers) == {self.session}))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for store, _ in self.runs() for t in (*store.keys, *store.values))


class FullKV:
    """A full-attention layer of a session: its layer of the session's block table."""

    def __init__(self, table: BlockTable, layer: int):
        self.table, self.layer = table, layer
        self.storage = table.pool.storage

    def reserve(self, end: int) -> None:
        self.table.reserve(end)

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[Segments, int | None]:
        """Write stored rows k, v ([kv_heads, n, width], `Storage.encode_kv`'s) at [start, start + n); return the
        stored runs of keys and values [0, start + n) and the first key position (always 0: runs are in
        position order)."""
        return self.write(k, v, start), 0

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> Segments:
        """Write stored rows (a saved state's) at [start, start + n)."""
        return self.table.update(self.layer, k, v, start)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return ()  # held by the table, counted once (BlockTable.owned_bytes)

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored keys and values of [0, end), joined into one new tensor pair (a saved state's layer)."""
        runs = [(store.keys[self.layer][:, : min(stop, end) - store.base],
                 store.values[self.layer][:, : min(stop, end) - store.base])
                for store, stop in self.table.runs() if store.base < end]
        return torch.cat([k for k, _ in runs], dim=1), torch.cat([v for _, v in runs], dim=1)


class RingKV:
    """A sliding-window layer: the last `window` positions, position p in entry p % window."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, storage: Storage, held_from: int = 0):
        self.keys, self.values, self.storage = keys, values, storage
        self.held_from = held_from
        self.writes = 0
        # (start, held_from, keys, values, writes) of the entries the last verify pass overwrote, from
        # `start` on, and what `writes` was once it wrote (a later write makes the undo stale)
        self.undo: tuple[int, int, torch.Tensor, torch.Tensor, int] | None = None

    @classmethod
    def empty(cls, kv_heads: int, head_dim: int, window: int, storage: Storage, device) -> RingKV:
        shape = (kv_heads, window, storage.width(head_dim))
        return cls(state_memory(shape, storage.dtype, device), state_memory(shape, storage.dtype, device), storage)

    @property
    def window(self) -> int:
        return self.keys.shape[1]

    def reserve(self, end: int) -> None:
        """A ring never grows."""

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[Segments, int | None]:
        """Write stored rows k, v ([kv_heads, n, width], `Storage.encode_kv`'s) at [start, start + n); return
        the stored keys the new queries may attend (one run).

        One token (decode): the ring itself after the write, entries unordered but
        all inside the window; first position None means "no mask needed".
        A chunk: the held positions the chunk's first query still sees, in order,
        followed by the chunk (the ring transiently holds more than W, never less).
        """
        n, w = k.shape[1], self.window
        end = start + n
        if n == 1:
            self._write(k, v, start)
            filled = min(end, w)
            return [(self.keys[:, :filled], self.values[:, :filled])], None
        first = max(self.held_from, start - w + 1)
        entries = torch.arange(first, start, device=k.device) % w
        keys = torch.cat((self.keys[:, entries], k), dim=1)
        values = torch.cat((self.values[:, entries], v), dim=1)
        keep = min(n, w)
        self._write(k[:, n - keep :], v[:, n - keep :], end - keep)
        return [(keys, values)], first

    def _write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        entries = torch.arange(start, start + k.shape[1], device=k.device) % self.window
        self.writes += 1  # before the first byte moves: a write that fails midway still counts
        self.keys[:, entries] = k
        self.values[:, entries] = v
        self.held_from = max(self.held_from, start + k.shape[1] - self.window)

    def keep_undo(self, start: int, n: int) -> None:
        """Before a verify pass writes [start, start + n): keep the entries it overwrites (`truncate`)."""
        if n > self.window:  # it would overwrite positions the rolled-back state still needs
            self.undo = None
            return
        entries = torch.arange(start, start + n, device=self.keys.device) % self.window
        self.undo = (start, self.held_from, self.keys[:, entries].clone(), self.values[:, entries].clone(),
                     self.writes + 1)

    def roll_back(self, position: int) -> None:
        """Back to `position`, at or past where the last verify pass began: the entries it wrote past
        `position` hold again what they held before."""
        assert self.undo is not None
        start, held_from, keys, values, _ = self.undo
        entries = torch.arange(position, start + keys.shape[1], device=keys.device)
        self.keys[:, entries % self.window] = keys[:, entries - start]
        self.values[:, entries % self.window] = values[:, entries - start]
        self.held_from = max(held_from, position - self.window)

    def copy_prefix(self, upto: int) -> RingKV:
        # clone_refusal admits upto >= position - 1 once the ring has wrapped, so the copy
        # holds what the donor holds. Entry upto % W may carry the donor's position `upto`:
        # the clone's next write replaces it before anything reads it.
        return RingKV(state_copy(self.keys), state_copy(self.values), self.storage, self.held_from)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values


LayerKV = FullKV | RingKV


def new_layers(windows: tuple[int | None, ...], table: BlockTable, kv_heads: int, head_dim: int,
               device) -> list[LayerKV]:
    """A session's layers: a ring per sliding layer (in the table's storage), its block table's layer per full one."""
    full = itertools.count()
    storage = table.pool.storage
    return [RingKV.empty(kv_heads, head_dim, w, storage, device) if w else FullKV(table, next(full)) for w in windows]


def reserve(layers: Sequence, end: int) -> None:
    """Grow every full layer for writes up to `end`, before a forward pass writes any of them."""
    for layer in layers:
        layer.reserve(end)


def keep_ring_undo(layers: Sequence, start: int, n: int) -> None:
    for layer in layers:
        if isinstance(layer, RingKV):
            layer.keep_undo(start, n)


def rings_undoable(layers: Sequence, position: int) -> bool:
    """Whether every ring can roll back to `position`: it kept what its last verify pass overwrote past it."""
    return all(layer.undo is not None and layer.undo[0] <= position and layer.undo[4] == layer.writes
               for layer in layers if isinstance(layer, RingKV))


def undo_rings(layers: Sequence, position: int) -> None:
    for layer in layers:
        if isinstance(layer, RingKV):
            layer.roll_back(position)


def held_from(layers: Sequence) -> list[int]:
    """Oldest held position of each sliding layer, in layer order (base.clone_refusal's argument)."""
    return [layer.held_from for layer in layers if isinstance(layer, RingKV)]


def ring_writes(layers: Sequence) -> int:
    return sum(layer.writes for layer in layers if isinstance(layer, RingKV))


def layers_bytes(layers: Sequence) -> int:
    """Bytes of the layers' own tensors (rings, recurrent states); full layers are their table's."""
    return sum(t.numel() * t.element_size() for layer in layers for t in layer.tensors())


# A row's runs as attention reads them (attention.py, ordered_attention.py): Segments in position order, each
# run starting at a block boundary, every run but the last holding whole blocks.

def pieces(runs: Segments, storage: Storage, size: int = BLOCK_TOKENS) -> Segments:
    """The runs as attention reads them: as they are where stored in the weights' dtype, else in pieces of
    `size` positions from each run's start (a multiple of BLOCK_TOKENS), each decoded when read."""
    if storage.exact:
        return runs
    return [(k[:, at:at + size], v[:, at:at + size]) for k, v in runs for at in range(0, k.shape[1], size)]


def shareable(runs: Segments) -> int:
    """The keys of a decode row's first run that several rows may read together: whole blocks, and some of
    its keys left after them (its new one is)."""
    n = runs[0][0].shape[1]
    return (n if len(runs) > 1 else n - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def own_runs(runs: Segments, shared: int) -> Segments:
    """A row's runs after its first `shared` keys (a run starts at a block boundary, so each of these does)."""
    (k, v), rest = runs[0], runs[1:]
    return [(k[:, shared:], v[:, shared:])] + rest if k.shape[1] > shared else rest
