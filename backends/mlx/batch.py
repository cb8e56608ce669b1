"""The persistent decode batch: sessions decoding together share one mlx-lm
batch cache per layer (`BatchKVCache`, `BatchRotatingKVCache`; a recurrent
layer's `ArraysCache` stacks its rows' states along the batch axis, as mlx-lm's
BatchGenerator merges them).

Design rule: merging every session's cache into a batch on every step copies
all the KV twice per step (merge, then extract); measured by
tools/mlx_batch_bench.py. So rows join (extend) and leave (filter, extract)
only when the set of decoding sessions changes; a step then writes in place.
The batch is the set of sessions of the last decode call: a row left out of a
call leaves the batch, back to a standalone cache of its own.

Rows of several positions (speculation's verify rows) share the step: every row
writes the step's longest chunk, a shorter one right-padded, and then forgets
its padding: each row shifts right by what it forgets (as mlx-lm's
`prepare(right_padding=...)`/`finalize()` do: mlx_lm_caches.forget_last), so every row stays right-aligned at the write index
and the forgotten positions become left padding, masked. A row rolled back
(`forget`) forgets its last positions the same way. The shift copies every
row's caches, so the positions to forget are held (`_forgotten`) and shifted
once, when the caches are next read: a verify step and the roll backs after it
cost one copy. Once every row has `COMPACT_PADDING` positions of left padding,
they are cut (`filter`), so the cache grows with the longest row's positions,
not with the steps' paddings.

Fault rule: mlx-lm caches advance their offsets inside the model call, layer by
layer, and a failed `mx.eval` leaves them pointing at arrays that never came to
be. So a failed step (or join) is undone only when no cache moved (`unmoved`);
otherwise the batch is abandoned: every row's session is `lost` (never read
again) and the batch starts empty, consistent, with the next call's sessions.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from kvfork.backends.mlx import recurrent
from kvfork.backends.mlx.mlx_lm_caches import forget_last, write_index


def cache_marks(caches: Sequence[Any]) -> list[Any]:
    """Where each cache stands, to tell whether a failed call moved it: a KV cache by its
    offset, a recurrent state by its arrays (recurrent.py). Any other cache cannot be told
    apart: it always counts as moved."""
    def mark(c: Any) -> Any:
        if isinstance(c, ArraysCache):
            return recurrent.marks(c)
        return (c.offset, write_index(c)) if hasattr(c, "offset") else object()
    return [mark(c) for c in caches]


def unmoved(before: list[Any], after: list[Any]) -> bool:
    def same(a: Any, b: Any) -> bool:  # ints by value; arrays (offsets, states) by identity, replaced on update
        return a is b or (isinstance(a, int) and isinstance(b, int) and a == b)
    return len(before) == len(after) and all(isinstance(x, tuple) and isinstance(y, tuple) and all(map(same, x, y))
                                             for x, y in zip(before, after))


# Left padding every row holds before it is cut: cutting copies the batch's caches (a gather), so it
# waits until the masked positions every step attends over are worth more than one copy.
COMPACT_PADDING = 64


class DecodeBatch:
    def __init__(self, model: nn.Module):
        self.model = model
        self.rows: list[Any] = []  # sessions, in row order
        self._caches: list[Any] | None = None  # one batch cache per layer
        self._forgotten: list[int] | None = None  # per row: its last positions to forget, not yet shifted out
        self.dead: set[int] = set()  # rows of released sessions, dropped at the next compaction

    @property
    def caches(self) -> list[Any] | None:
        """The batch caches, every row right-aligned at the write index (what was forgotten shifted out)."""
        if self._forgotten is not None:
            self._shift_out(self._forgotten)
            self._forgotten = None
        return self._caches

    @caches.setter
    def caches(self, caches: list[Any] | None) -> None:
        self._caches, self._forgotten = caches, None

    def has(self, session) -> bool:
        return any(r is session for r in self.rows)

    def row(self, session) -> int:
        return next(i for i, r in enumerate(self.rows) if r is session)

    def release(self, session) -> None:
        self.dead.add(self.row(session))

    def leave(self, session) -> None:
        """Take one session out, back to standalone caches."""
        self._reshape(keep=[r for r in self.rows if r is not session])

    def sync(self, sessions: Sequence[Any]) -> list[int]:
        """Make the batch hold exactly `sessions`; returns each one's row."""
        wanted = {id(s) for s in sessions}
        self._reshape(keep=[r for r in self.rows if id(r) in wanted])
        joiners = [s for s in sessions if not self.has(s)]
        if joiners:
            self._join(joiners)
        index = {id(r): i for i, r in enumerate(self.rows)}
        return [index[id(s)] for s in sessions]

    def step(self, row_chunks: Sequence[Sequence[int]]) -> mx.array:
        """One step of every row, each writing its chunk (one token, or a token and its draft);
        logits [rows, longest chunk, vocab], a row's own positions first."""
        longest = max(len(chunk) for chunk in row_chunks)
        padded = [[*chunk, *[0] * (longest - len(chunk))] for chunk in row_chunks]
        logits = self.model(mx.array(padded), cache=self.caches)
        self._forget_last([longest - len(chunk) for chunk in row_chunks])
        return logits

    def forget(self, session, n: int) -> None:
        """Roll a row back: it forgets its last `n` positions (full-attention layers only: `rolls_back`)."""
        counts = [0] * len(self.rows)
        counts[self.row(session)] = n
        self._forget_last(counts)

    def _forget_last(self, counts: list[int]) -> None:
        if any(counts):
            held = self._forgotten or [0] * len(counts)
            self._forgotten = [a + b for a, b in zip(held, counts)]

    def _shift_out(self, counts: list[int]) -> None:
        assert self._caches is not None
        for cache in self._caches:
            forget_last(cache, counts)
        if min(self._caches[0].left_padding.tolist()) >= COMPACT_PADDING:  # every layer pads its rows alike
            for cache in self._caches:
                cache.filter(mx.arange(len(counts)))

    def marks(self) -> list[Any]:
        return cache_marks(self.caches or ())

    def abandon(self) -> None:
        """Drop every row after a failure left the batch's caches untrustworthy."""
        for i, session in enumerate(self.rows):
            if i not in self.dead:
                session.caches, session.lost = None, True
        self.rows, self.caches, self.dead = [], None, set()

    def compact(self) -> None:
        if self.dead:
            self._reshape(keep=[r for i, r in enumerate(self.rows) if i not in self.dead])

    def nbytes(self) -> int:
        self.compact()
        return sum(c.nbytes for c in self.caches) if self.caches else 0

    def row_bytes(self) -> int:
        return self.nbytes() // len(self.rows)

    def _reshape(self, keep: list[Any]) -> None:
        """Filter down to `keep`; live rows not kept get their own caches back."""
        if len(keep) == len(self.rows) and not self.dead:
            return
        for i, session in enumerate(self.rows):
            if i not in self.dead and not any(k is session for k in keep):
                session.caches = [c.extract(i) for c in self.caches]
        index = [i for i, r in enumerate(self.rows) if i not in self.dead and any(k is r for k in keep)]
        self.rows, self.dead = [self.rows[i] for i in index], set()
        if not self.rows:
            self.caches = None
            return
        for cache in self.caches:
            cache.filter(mx.array(index))

    def _join(self, sessions: list[Any]) -> None:
        layers = len(sessions[0].caches)
        merged = [type(sessions[0].caches[l]).merge([s.caches[l] for s in sessions]) for l in range(layers)]
        if self.caches is None:
            self.caches = merged
        else:
            for cache, new in zip(self.caches, merged):
                cache.extend(new)
        self.rows.extend(sessions)
        for s in sessions:
            s.caches = None
