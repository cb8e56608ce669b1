"""Constrained rows on the runner: each holds a matcher, and its next mask is computed off the critical path.

The engine knows grammars only through two small protocols of its contract (engine/api.py; the daemon's
server/generate/grammar.py implements them with llguidance): a `Constraint` makes a fresh
`TokenMatcher` per request, and a matcher advances on each committed token and
fills the packed allowed-token bitmask of the next one (bit t of word t // 32,
the layout llguidance and xgrammar share), which `SamplerState.allowed` carries
to the backend's batched sample.

Design rules:
- the mask for step k+1 is computed while step k+1's forward pass runs: the
  runner hands the sampled token over right after sampling (`after_sample`) and
  joins just before the next sample (`before_sample`); a pool thread advances the
  matcher and fills the mask (llguidance drops the GIL while it works);
- unconstrained rows pay nothing: no job, no mask, `allowed` stays None;
- a row whose grammar leaves no legal token is not sampled under its mask (an
  all -inf row would turn to NaN in a softmax): it samples as a discarded greedy
  row and then ends alone, with an error naming the grammar.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from kvfork.backends.base import SamplerState, SamplingParams
from kvfork.server.engine.api import Constraint, TokenMatcher

_DISCARD = SamplingParams()  # greedy, no mask: a row whose grammar is dead samples this and is thrown away


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class _Row:
    def __init__(self, matcher: TokenMatcher, words: int):
        self.matcher = matcher
        self.mask = np.zeros(words, dtype=np.int32)
        self.pending: Future | None = None
        self.dead: str | None = None  # why the grammar allows nothing, once it does not


class ConstrainedRows:
    """The runner's constrained requests, by rid."""

    def __init__(self, vocab_size: int, workers: int | None = None):
        self.words = mask_words(vocab_size)
        self._rows: dict[int, _Row] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._workers = workers or min(4, os.cpu_count() or 1)

    def start(self, rid: int, constraint: Constraint | None) -> None:
        """A request entered a slot: its first mask is computed while its prompt is prefilled."""
        if constraint is None:
            return
        row = _Row(constraint.matcher(), self.words)
        self._rows[rid] = row
        row.pending = self._submit(row, None)

    def before_sample(self, rids: Sequence[int], states: Sequence[SamplerState]) -> list[SamplerState]:
        """Join each constrained row's mask and put it on its state; a dead row samples as a discard."""
        if not self._rows:
            return list(states)
        out = list(states)
        for i, rid in enumerate(rids):
            row = self._rows.get(rid)
            if row is None:
                continue
            if row.pending is not None:
                row.dead = row.pending.result()
                row.pending = None
            if row.dead:
                out[i] = SamplerState(_DISCARD)
            else:
                states[i].allowed = row.mask
        return out

    def admissible(self, rid: int, tokens: Sequence[int]) -> int:
        """How many leading drafted `tokens` the row's grammar accepts from where it is (an unconstrained
        row: all); 0 where its matcher cannot check a draft (no `validate`) or its grammar is dead."""
        row = self._rows.get(rid)
        if row is None:
            return len(tokens)
        validate = getattr(row.matcher, "validate", None)
        if validate is None:
            return 0
        if row.pending is not None:  # the matcher is being advanced: join it first
            row.dead = row.pending.result()
            row.pending = None
        if row.dead:
            return 0
        try:
            return max(0, min(len(tokens), int(validate(list(tokens)))))
        except Exception:  # a matcher that cannot check this draft: none of it
            return 0

    def after_sample(self, rid: int, token: int) -> str | None:
        """The row's token is sampled: advance its matcher off the critical path. Returns why it must end, or None."""
        row = self._rows.get(rid)
        if row is None:
            return None
        if row.dead:
            return f"the grammar allows no next token: {row.dead}"
        row.pending = self._submit(row, token)
        return None

    def end(self, rid: int) -> None:
        row = self._rows.pop(rid, None)
        if row is not None and row.pending is not None:
            row.pending.cancel()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _submit(self, row: _Row, token: int | None) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="kvfork-mask")
        return self._pool.submit(_step, row, token)


def _step(row: _Row, token: int | None) -> str | None:
    try:
        if token is not None:
            row.matcher.advance(token)
        return row.matcher.fill_mask(row.mask)
    except Exception as exc:  # a matcher bug fails its own request, never the runner
        return f"{type(exc).__name__}: {exc}"

