"""Copies of one layer's KV state: the clone primitive, on mlx-lm caches.

A layer's state is first seen as a *view*: keys and values in temporal order
with the position of their first entry. A clone then copies `[.., upto)` of the
view into NEW arrays. Design rules:
- never hand an array object to two caches: mlx-lm writes into its buffers
  with slice assignment, so a shared object would carry one session's writes
  into the other;
- leave room: a tightly sized copy grows (a full copy) on its first write,
  which measured dearer than the clone itself at 2,047 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from kvfork.backends.mlx.mlx_lm_caches import in_time_order, set_write_index

STEP = KVCache.step


@dataclass
class LayerView:
    keys: mx.array  # [1, heads, n, dim], temporal order
    values: mx.array
    first: int  # position of entry 0


def with_room(n: int) -> int:
    """Positions for n tokens plus at least one growth step, rounded to whole steps."""
    return (n + 2 * STEP - 1) // STEP * STEP


def view(cache, row: int | None = None, row_offset: int = 0, row_padding: int = 0) -> LayerView:
    """The positions a standalone cache (row None) or a batch row still holds."""
    if isinstance(cache, BatchKVCache):
        held = (slice(row, row + 1), slice(None), slice(row_padding, row_padding + row_offset))
        return LayerView(cache.keys[held], cache.values[held], 0)
    if isinstance(cache, BatchRotatingKVCache):
        cache = cache.extract(row)  # a copy of at most the window
    if cache.keys is None:
        return LayerView(None, None, 0)
    if isinstance(cache, RotatingKVCache):
        keys, values = in_time_order(cache, cache.keys), in_time_order(cache, cache.values)
        return LayerView(keys, values, cache.offset - keys.shape[2])
    return LayerView(cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :], 0)


def placed(part: mx.array, positions: int, at: int) -> mx.array:
    """A new buffer of `positions` along time holding `part` from position `at`, zeros elsewhere."""
    shape = list(part.shape)
    if shape[2] == positions:
        # Assigning over a whole buffer would just alias `part`, the donor's buffer.
        return part * 1
    buffer = mx.zeros(shape[:2] + [positions] + shape[3:], part.dtype)
    buffer[..., at : at + shape[2], :] = part
    return buffer


def clone_full(v: LayerView, upto: int) -> KVCache:
    cache = KVCache()
    if upto > 0:
        room = with_room(upto)
        cache.keys = placed(v.keys[..., :upto, :], room, 0)
        cache.values = placed(v.values[..., :upto, :], room, 0)
    cache.offset = upto
    return cache


def clone_sliding(v: LayerView, held_from: int, upto: int, window: int) -> tuple[RotatingKVCache, int]:
    """A ring of `window` positions holding what `[.., upto)` needs; returns it and its oldest held position.

    The ring is laid out as mlx-lm leaves one after decode steps: before it is
    full, entries from the ring's start and the write index at their count; once
    full, time order with the write index at the window, so the next write lands
    at the ring's start, on the oldest. Position `upto - window` is never attended
    again; when the donor no longer holds it, its place stays zero.
    """
    start = max(held_from, upto - window, 0)
    part_k = v.keys[..., start - v.first : upto - v.first, :]
    part_v = v.values[..., start - v.first : upto - v.first, :]
    cache = RotatingKVCache(max_size=window, keep=0)
    n = upto - start
    at = 0 if upto < window else window - n
    cache.keys, cache.values = placed(part_k, window, at), placed(part_v, window, at)
    set_write_index(cache, n if upto < window else window)
    cache.offset = upto
    return cache, start


def arrays(cache) -> list[mx.array]:
    held = cache.cache if isinstance(cache, ArraysCache) else (cache.keys, cache.values)
    return [a for a in held if a is not None]
