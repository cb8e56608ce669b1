"""One index of the KV states a new request may start from, in one trie over token blocks.

Four tiers, one lookup (`Index.best`):
- memory: the prefix cache, snapshots of finished prompts the runner holds as sessions
  (least recently used first out, capped in entries and bytes);
- disk: the files of the prefix cache's disk tier (disk.py does the file work);
- named: the state a named session keeps between its requests (sessions.py keeps the table);
- running: the prompts of requests in inference slots, as far as each has committed it (donors).

Design rules:
- one place stores an entry and one removes it (`_store`, `_remove`): the trie, each tier's
  recency order and byte count change there and nowhere else, and a tier's watcher (`watch`:
  server/watch/kv_events.py's KV events) hears of it there;
- an entry serves only requests of its scope (api.Scope.digest, under the index's key: `digest`): each
  scope has its own trie;
- a match follows matching.usable_upto, the rule every kind of reuse shares: the longest usable
  match wins, ties go to the most recently used entry (a donor: the most recently admitted);
- a sliding layer's state serves only what its windows still hold (matching.window_floor); a
  recurrent state only its position and its checkpoints (backends.base.clone_positions), so a
  memory entry of such a model is its prompt less one token, and keeps the request's checkpoints;
- an entry outlives the request it came from; what the memory tier evicts goes back to its
  caller, who offers it to the disk tier or releases it.

The trie: a node per block of BLOCK tokens (SGLang's radix tree with pages; mlx-lm's
LRUPromptCache keys one token per node). An entry hangs at the node of its last whole block,
its tail (under BLOCK tokens) compared on lookup. A lookup walks the prompt's blocks down
from the scope's root; every entry it meets on the way, and every entry below a child it
leaves the path at (sharing the path so far, and as much of that child's block), is a
candidate with a known shared length, so no token is compared twice.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Hashable, Iterator, Protocol, Sequence

from kvfork.backends.base import ModelInfo, clone_positions
from kvfork.server.engine.api import Scope
from kvfork.server.engine.policy.entries import Entry, Found, Match, Tier
from kvfork.server.engine.policy.matching import Source, common_prefix, usable_upto, window_floor

BLOCK = 16  # tokens per trie node



class Watcher(Protocol):
    """Told of a tier's entries as they are stored and removed (`scope`: the entry's scope digest)."""

    def stored(self, tokens: Sequence[int], scope: str) -> None: ...
    def removed(self, tokens: Sequence[int], scope: str) -> None: ...


class _Node:
    __slots__ = ("children", "entries", "size")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.entries: list[Entry] = []
        self.size = 0  # entries here and below

    def below(self) -> Iterator[Entry]:
        """The entries here and in every node below, depth first, on an explicit stack: a trie over a
        long prompt is as deep as its blocks, far deeper than Python's recursion limit."""
        stack = [self]
        while stack:
            node = stack.pop()
            yield from node.entries
            stack.extend(node.children.values())


class _Trie:
    def __init__(self) -> None:
        self._roots: dict[str, _Node] = {}

    def add(self, entry: Entry) -> None:
        node = self._roots.setdefault(entry.scope, _Node())
        node.size += 1
        for block in _blocks(entry.tokens):
            node = node.children.setdefault(block, _Node())
            node.size += 1
        node.entries.append(entry)

    def remove(self, entry: Entry) -> None:
        path = [self._roots[entry.scope]]
        for block in _blocks(entry.tokens):
            path.append(path[-1].children[block])
        path[-1].entries.remove(entry)
        for node in path:
            node.size -= 1
        for parent, block, child in reversed(list(zip(path, _blocks(entry.tokens), path[1:]))):
            if child.size == 0:
                del parent.children[block]
        if path[0].size == 0:
            del self._roots[entry.scope]

    def candidates(self, tokens: Sequence[int], scope: str) -> Iterator[tuple[Entry, int]]:
        """Every entry of `scope` sharing at least a first token with `tokens`, with how many they share."""
        node, depth = self._roots.get(scope), 0
        while node is not None:
            at = depth * BLOCK
            for entry in node.entries:
                yield entry, common_prefix(entry.tokens, tokens, at)
            block = tuple(tokens[at:at + BLOCK])
            for edge, child in node.children.items():
                if edge != block and (shared := at + common_prefix(edge, block)):
                    yield from ((entry, shared) for entry in child.below())
            node, depth = node.children.get(block) if len(block) == BLOCK else None, depth + 1


def _blocks(tokens: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    for at in range(0, len(tokens) - BLOCK + 1, BLOCK):
        yield tokens[at:at + BLOCK]


class Index:
    def __init__(self, info: ModelInfo, max_entries: int, max_bytes: int | None, min_tokens: int, scope_key: bytes):
        """`max_entries`, `max_bytes`: the memory tier's caps; `min_tokens`: its shortest entry and match;
        `scope_key`: the key scopes are named under (`digest`)."""
        self.max_entries, self.max_bytes, self.min_tokens = max_entries, max_bytes, min_tokens
        self._scope_key = scope_key
        self._info = info
        self._trie = _Trie()
        self._tiers: dict[Tier, OrderedDict[Hashable, Entry]] = {t: OrderedDict() for t in Tier.__args__}
        self._bytes: dict[Tier, int] = {t: 0 for t in Tier.__args__}
        self._reads: dict[Tier, int] = {t: 0 for t in Tier.__args__}
        self._watchers: dict[Tier, Watcher] = {}
        self._clock = 0

    # ---- the one place entries are stored and removed ----

    def _store(self, entry: Entry) -> None:
        self._clock += 1
        entry.stamp = entry.stamp or self._clock
        entry.created = entry.created or time.monotonic()
        self._trie.add(entry)
        self._tiers[entry.tier][self._name(entry)] = entry
        self._bytes[entry.tier] += entry.nbytes
        self._reads[entry.tier] += entry.reads
        if (watcher := self._watchers.get(entry.tier)) is not None:
            watcher.stored(entry.tokens, entry.scope)

    def _remove(self, entry: Entry) -> None:
        self._trie.remove(entry)
        del self._tiers[entry.tier][self._name(entry)]
        self._bytes[entry.tier] -= entry.nbytes
        self._reads[entry.tier] -= entry.reads
        if (watcher := self._watchers.get(entry.tier)) is not None:
            watcher.removed(entry.tokens, entry.scope)

    def watch(self, tier: Tier, watcher: Watcher) -> None:
        """From now on `watcher` hears of each of `tier`'s entries stored and removed; those there already
        are stored at once."""
        self._watchers[tier] = watcher
        for entry in self._tiers[tier].values():
            watcher.stored(entry.tokens, entry.scope)

    @staticmethod
    def _name(entry: Entry) -> Hashable:
        """An entry's name in its tier: its owner, or for cached states, scope and tokens."""
        return entry.key if entry.tier in ("memory", "disk") else entry.owner

    # ---- reads ----

    def digest(self, scope: Scope) -> str:
        """`scope` as its entries name it (api.Scope.digest)."""
        return scope.digest(self._scope_key)

    def count(self, tier: Tier) -> int:
        return len(self._tiers[tier])

    def nbytes(self, tier: Tier) -> int:
        return self._bytes[tier]

    def reads(self, tier: Tier) -> int:
        """Bytes of blocks the tier's entries read by reference (`Entry.reads`; pooled once their writers end)."""
        return self._reads[tier]

    def entries(self, tier: Tier) -> list[Entry]:
        """A tier's entries, least recently used first."""
        return list(self._tiers[tier].values())

    def touch(self, entry: Entry) -> None:
        """`entry` was used: it becomes the most recent of its tier."""
        tier, name = self._tiers[entry.tier], self._name(entry)
        if tier.get(name) is entry:
            self._clock += 1
            entry.stamp = self._clock
            entry.uses += 1
            tier.move_to_end(name)

    # ---- the one lookup ----

    def best(self, tokens: Sequence[int], scope: Scope, disk: bool = True) -> Found:
        """Where `scope`'s prompt `tokens` can start from: the memory tier's usable matches of at least
        `min_tokens`, best first; the best file (with `disk`); the best donor."""
        found, ranked = Found(self.digest(scope)), {t: [] for t in ("memory", "disk", "running")}
        tokens = tuple(tokens)
        for entry, shared in self._trie.candidates(tokens, found.scope):
            if entry.tier in ranked and (entry.tier != "disk" or disk):
                upto = usable_upto(shared, tokens, self._source(entry))
                if upto > 0:
                    ranked[entry.tier].append(Match(entry, upto))
        for matches in ranked.values():
            matches.sort(key=lambda m: (m.upto, m.entry.stamp), reverse=True)
        found.memory = [m for m in ranked["memory"] if m.upto >= self.min_tokens]
        found.disk = ranked["disk"][0] if ranked["disk"] else None
        found.donor = self._source(ranked["running"][0].entry) if ranked["running"] else None
        return found

    def _source(self, entry: Entry) -> Source:
        """An entry as the matching rule sees it."""
        windows = self._info.sliding_windows
        committed = min(entry.position, len(entry.tokens))
        positions = None
        if self._info.recurrent:
            positions = (clone_positions(entry.position, self._info, entry.kept) if entry.tier == "running"
                         else (*entry.kept, len(entry.tokens)))
        return Source(entry.owner if entry.owner is not None else entry.sid, entry.tokens, committed, entry.stamp,
                      clone_floor=window_floor(entry.position, windows), positions=positions)

    # ---- the memory tier: the prefix cache ----

    def worth_capturing(self, prompt_len: int) -> bool:
        return self.max_entries > 0 and prompt_len >= self.min_tokens

    def keep(self, tokens: Sequence[int], sid: int, nbytes: int, scope: Scope, kept: tuple[int, ...] = ()
             ) -> tuple[bool, list[Entry]]:
        """A snapshot of `scope`'s prompt `tokens`, held as session `sid`, joins the memory tier. Returns
        whether it was kept (not: the same prompt is held already, refreshed instead, or it could never
        fit) and the least recently used entries it pushed out, which the caller offers to the disk
        tier or releases."""
        kv = self._info.kv
        entry = Entry("memory", self.digest(scope), tuple(tokens), sid=sid, nbytes=nbytes, kept=kept,
                      reads=kv.positions(len(tokens)) * kv.full_bytes_per_token if kv.shares else 0)
        held = self._tiers["memory"].get(entry.key)
        if held is not None:  # the same prompt again: refresh it, keep the older snapshot
            self.touch(held)
            return False, []
        if self.max_entries == 0 or (self.max_bytes is not None and nbytes > self.max_bytes):
            return False, []
        self._store(entry)
        out = []
        while self.count("memory") > self.max_entries or (
                self.max_bytes is not None and self.nbytes("memory") > self.max_bytes):
            out.append(self.evict_oldest("memory"))
        return True, out

    def evict_oldest(self, tier: Tier) -> Entry:
        entry = next(iter(self._tiers[tier].values()))
        self._remove(entry)
        return entry

    def evict_memory(self, need: int, spare: Found | None = None) -> list[Entry]:
        """Least recently used memory entries until `need` bytes are freed (or none is left), each freeing its
        own bytes and the blocks it reads (`Entry.reads`); `spare`'s matches (the lookup of the request making
        room: what it would reuse) last."""
        spared = {id(m.entry) for m in spare.memory} if spare else set()
        order = sorted(self._tiers["memory"].values(), key=lambda e: id(e) in spared)  # stable: LRU within each
        out, freed = [], 0
        for entry in order:
            if freed >= need:
                break
            self._remove(entry)
            out.append(entry)
            freed += entry.nbytes + entry.reads
        return out

    # ---- the disk tier's files (disk.py does the file work) ----

    def add_file(self, entry: Entry) -> Entry:
        """A file written (or found at start); a newer file of an entry held already takes its place
        (the same tokens: nothing stored nor removed). Returns the entry held."""
        held = self._tiers["disk"].get(entry.key)
        if held is None:
            self._store(entry)
            return entry
        self._bytes["disk"] += entry.nbytes - held.nbytes
        held.owner, held.nbytes = entry.owner, entry.nbytes
        self.touch(held)
        return held

    def drop(self, entry: Entry) -> bool:
        """Out of the index, if it is still in; whether it was."""
        if self._tiers[entry.tier].get(self._name(entry)) is not entry:
            return False
        self._remove(entry)
        return True

    def covering_files(self, tokens: Sequence[int], scope: str) -> list[Entry]:
        """The files of `scope` (a digest) that serve every match a file of `tokens` would (`serves`)."""
        tokens = tuple(tokens)
        return [e for e in self._tiers["disk"].values() if e.scope == scope and self.serves(e.tokens, tokens)]

    def serves(self, held: tuple[int, ...], tokens: tuple[int, ...]) -> bool:
        """Whether a state of `held` serves every match a state of `tokens` would: the same prompt, or a
        longer one beginning with it where any prefix of a state can be cloned (no sliding window to
        have moved on, no recurrent state held at its end only: backends.base.clone_refusal)."""
        if held == tokens:
            return True
        info = self._info
        return (not info.sliding_windows and not info.recurrent and len(held) > len(tokens)
                and held[: len(tokens)] == tokens)

    # ---- named sessions' state (sessions.py keeps the table) ----

    def hold_named(self, entry: Entry) -> None:
        self._store(entry)

    # ---- running requests: donors ----

    def run(self, rid: int, prompt: Sequence[int], scope: Scope, admitted: int) -> None:
        """A request in an inference slot donates its prompt as far as it has committed it."""
        if rid not in self._tiers["running"]:
            self._store(Entry("running", self.digest(scope), tuple(prompt), rid, position=0, stamp=admitted))

    def source_of(self, rid: int) -> Source:
        """A running request as the matching rule sees it (a donor)."""
        return self._source(self._tiers["running"][rid])

    def moved(self, rid: int, position: int, kept: tuple[int, ...]) -> None:
        """A running request's committed position and checkpoints, as the runner published them."""
        entry = self._tiers["running"].get(rid)
        if entry is not None:
            entry.position, entry.kept = position, kept

    def stop(self, rid: int) -> None:
        """It gives nothing from now on (it is leaving)."""
        entry = self._tiers["running"].get(rid)
        if entry is not None:
            self._remove(entry)
