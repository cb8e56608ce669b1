"""Snapshots of finished prompts, keyed by their exact token sequence, LRU.

The control loop owns the cache; the sessions in it are opaque handles that only
the runner touches (it clones from them, and releases what the cache evicts).

Design rules:
- a match is `min(common prefix, prompt length - 1)` (the rule matching.py shares
  with active reuse): the prompt's last token
  always runs through the model, so every request samples from fresh logits;
- the longest match wins, ties go to the most recently used entry;
- an entry of a model with sliding layers serves only what its windows still
  hold (matching.window_floor, the floor a donor gets): a match the backend
  would refuse is never reported;
- an entry of a model with recurrent layers serves its own length and its
  checkpoints only (the recurrent rule, base.clone_positions): the runner
  snapshots such a prompt one token before its end, so the same prompt sent
  again is served, and the snapshot keeps the request's message-boundary
  checkpoints, so a prompt sharing the conversation up to one is served there;
- a clone the backend refuses leaves its entry in place: the next candidate is
  tried, then a full prefill;
- entries outlive the request they came from; eviction goes by count and bytes;
- an entry serves only requests of the scope that computed it (api.Scope): the
  same prompt under two scopes is two entries, and a lookup sees its own only;
- an entry evicted is offered to `spill` (the disk tier): one it takes is not
  returned for release (the spill releases it once its state is on the host).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from server.engine.api import Scope
from server.engine.matching import Source, ranked_matches, window_floor


@dataclass
class CacheEntry:
    tokens: tuple[int, ...]
    session: Any  # backend session, at position len(tokens)
    nbytes: int
    scope: Scope = Scope()
    kept: tuple[int, ...] = ()  # positions it holds a recurrent checkpoint at (a model with recurrent layers)

    @property
    def key(self) -> tuple[Scope, tuple[int, ...]]:
        return self.scope, self.tokens


@dataclass(frozen=True)
class CacheMatch:
    entry: CacheEntry
    upto: int  # tokens a clone of the entry gives the request


class PrefixCache:
    def __init__(self, max_entries: int, max_bytes: int | None, min_tokens: int, windows: Iterable[int] = (),
                 recurrent: bool = False, spill: Callable[[CacheEntry], bool] | None = None):
        self.max_entries, self.max_bytes, self.min_tokens = max_entries, max_bytes, min_tokens
        self.spill = spill  # takes an evicted entry (True) or leaves it to be released
        self.windows = tuple(windows)  # the sliding layers' windows
        self.recurrent = recurrent  # the model has recurrent layers
        self._entries: OrderedDict[tuple[Scope, tuple[int, ...]], CacheEntry] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.watch: Any = None  # told of each entry stored and removed (server/kv_events.Watch)

    def __len__(self) -> int:
        return len(self._entries)

    def worth_capturing(self, prompt_len: int) -> bool:
        return self.max_entries > 0 and prompt_len >= self.min_tokens

    def lookup(self, prompt: Sequence[int], scope: Scope = Scope()) -> list[CacheMatch]:
        """Usable matches of `scope`'s entries, best first: longest, then most recently used."""
        sources = (Source.entry(key, key[1], stamp, clone_floor=window_floor(len(key[1]), self.windows),
                                positions=(*entry.kept, len(key[1])) if self.recurrent else None)
                   for stamp, (key, entry) in enumerate(self._entries.items()) if key[0] == scope)
        return [CacheMatch(self._entries[m.key], m.upto) for m in ranked_matches(prompt, sources)
                if m.upto >= self.min_tokens]

    def best(self, prompt: Sequence[int], scope: Scope = Scope()) -> int:
        matches = self.lookup(prompt, scope)
        return matches[0].upto if matches else 0

    def touch(self, entry: CacheEntry) -> None:
        if entry.key in self._entries:
            self._entries.move_to_end(entry.key)

    def insert(self, tokens: Sequence[int], session: Any, nbytes: int, scope: Scope = Scope(),
               kept: tuple[int, ...] = ()) -> list[Any]:
        """Add a snapshot of `scope`; returns the sessions to release (evicted, or the duplicate)."""
        key = scope, tuple(tokens)
        if key in self._entries:  # the same prompt again: refresh, keep the older snapshot
            self._entries.move_to_end(key)
            return [session]
        if self.max_entries == 0 or (self.max_bytes is not None and nbytes > self.max_bytes):
            return [session]
        self._entries[key] = CacheEntry(key[1], session, nbytes, scope, kept)
        self.nbytes += nbytes
        if self.watch is not None:
            self.watch.stored(key[1], scope)
        out = []
        while len(self._entries) > self.max_entries or (self.max_bytes is not None and self.nbytes > self.max_bytes):
            out.append(self._pop_oldest())
        return out

    def evict_bytes(self, need: int) -> list[Any]:
        """Evict least recently used entries until `need` bytes are freed (or the cache is empty)."""
        out, freed = [], 0
        while self._entries and freed < need:
            before = self.nbytes
            out.append(self._pop_oldest())
            freed += before - self.nbytes
        return out

    def clear(self) -> list[Any]:
        return [self._pop_oldest() for _ in range(len(self._entries))]

    def _pop_oldest(self) -> Any:
        _, entry = self._entries.popitem(last=False)
        self.nbytes -= entry.nbytes
        if self.watch is not None:
            self.watch.removed(entry.tokens, entry.scope)
        return None if self.spill is not None and self.spill(entry) else entry.session
