"""Recurrent state on mlx-lm caches: a hybrid model's `ArraysCache` layers (a short
convolution's last inputs, plus an SSM or delta-rule state), one row per session.

The state has a fixed size whatever the session's length, and holds the session's
position only (the recurrent rule, base.clone_positions). Design rule: mlx-lm models replace a
cache's arrays on every call (`cache[i] = new`) and never write into them, so
which array objects a cache holds tells whether a call moved it (batch.unmoved);
a copy still gets arrays of its own, as kvcopy.placed asks.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, make_prompt_cache


def state_bytes(model: nn.Module) -> int:
    """Bytes of one session's recurrent state, all layers, from one token run (0 for a model without)."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    return sum(c.nbytes for c in cache if isinstance(c, ArraysCache))


def copy_state(cache: ArraysCache, row: int | None = None) -> ArraysCache:
    """New arrays holding a standalone cache's state (row None), or one row of a batch's."""
    copy = ArraysCache(len(cache.cache))
    copy.cache = [None if a is None else (a if row is None else a[row : row + 1]) * 1 for a in cache.cache]
    return copy


def marks(cache: ArraysCache) -> tuple:
    """What a call that moves the cache replaces (compared by identity)."""
    return (*cache.cache, cache.left_padding, cache.lengths)
