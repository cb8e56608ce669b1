"""The one place kvfork reads and writes mlx-lm's private cache members.

No public API of mlx-lm gives a cache's write index or a rotating cache's ring in
time order, and kvfork needs both: to copy a sliding layer's ring into a clone
(kvcopy.py), to find a row of the decode batch (backend.py), and to tell whether a
failed step moved a cache (batch.py). A batch cache's rows forget their last
positions (`forget_last`) as its `prepare(right_padding=...)`/`finalize()` make
them, with row copies in place of its gather (`dynamic_roll`), which costs several
times more on the CPU (tools/mlx_batch_bench.py). They live here, read as mlx-lm's own code
uses them, for the versions in MLX_LM_VERSIONS: tests/backends/test_mlx_lm_caches.py pins
that range to the installed mlx-lm and to pyproject.toml's, and checks what each
member means, so an mlx-lm upgrade fails a test instead of a clone.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

MLX_LM_VERSIONS = ">=0.32,<0.33"  # checked; pyproject.toml pins the same range


def write_index(cache: Any) -> int | None:
    """Where a rotating or batch cache writes next (`_idx`); None for a cache without one."""
    return getattr(cache, "_idx", None)


def set_write_index(cache: Any, index: int) -> None:
    """A rotating cache built by hand (a clone's ring) writes next at `index`."""
    cache._idx = index


def in_time_order(cache: Any, array: mx.array) -> mx.array:
    """A rotating cache's keys or values, oldest position first (`_temporal_order`)."""
    return cache._temporal_order(array)


def forget_last(cache: Any, counts: list[int]) -> None:
    """Each row of a BatchKVCache forgets its last counts[i] positions: the row shifts right by as
    many, staying right-aligned at the write index, and the forgotten positions become left padding."""
    shift = mx.array(counts)
    cache.keys, cache.values = (mx.concatenate([mx.roll(a[i:i + 1], n, 2) if n else a[i:i + 1]
                                                for i, n in enumerate(counts)]) for a in (cache.keys, cache.values))
    cache.offset = cache.offset - shift
    cache.left_padding = cache.left_padding + shift
