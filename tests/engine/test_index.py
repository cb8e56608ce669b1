"""The index of reusable states (server/engine/cache/index.py): the trie against a brute-force scan, the prefix
cache's recency and eviction, the disk tier's files, running donors, and the one place entries change."""

from __future__ import annotations

import random

from kvfork.backends.base import KVCost, LayerAttention, ModelInfo
from kvfork.server.engine.api import Scope
from kvfork.server.engine.cache.index import BLOCK, Index
from kvfork.server.engine.policy.entries import Entry
from kvfork.server.engine.policy.matching import Source, ranked_matches, usable_match, window_floor

FULL = ModelInfo("t", 512, 4096, (LayerAttention("full"),), (2,), KVCost(1024), "float32", "cpu")
SLIDING = ModelInfo("t", 512, 4096, (LayerAttention("sliding", 8), LayerAttention("full")), (2,), KVCost(1024),
                    "float32", "cpu")


KEY = b"k" * 32  # the key scopes are named under (the disk tier's secret in the daemon)


def index(entries=16, nbytes=None, min_tokens=1, info=FULL) -> Index:
    return Index(info, entries, nbytes, min_tokens, KEY)


def cached(i: Index, tokens, sid, nbytes=1, scope=Scope()) -> list[int]:
    """Keep a snapshot; the sids it pushed out (or its own, when it was not kept)."""
    stored, out = i.keep(tokens, sid, nbytes, scope)
    return [e.sid for e in out] if stored else [sid]


def memory(i: Index, prompt, scope=Scope()) -> list[tuple[int, int]]:
    return [(m.entry.sid, m.upto) for m in i.best(prompt, scope).memory]


# ---- the trie finds what a scan of every entry finds ----

def test_the_trie_ranks_every_entry_as_a_scan_does():
    rng = random.Random(0)
    for info in (FULL, SLIDING):
        for _ in range(40):
            i = index(entries=1000, info=info)
            base = [rng.randrange(3) for _ in range(5 * BLOCK)]
            kept = {}
            for sid in range(rng.randrange(1, 25)):
                cut = rng.randrange(0, len(base))
                tokens = base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(0, 2 * BLOCK))]
                if tokens and cached(i, tokens, sid) == []:
                    kept[sid] = tuple(tokens)
            for _ in range(10):
                cut = rng.randrange(0, len(base))
                prompt = base[:cut] + [rng.randrange(3) for _ in range(rng.randrange(1, 2 * BLOCK))]
                stamps = {e.sid: e.stamp for e in i.entries("memory")}
                sources = [Source.entry(sid, t, stamps[sid], clone_floor=window_floor(len(t), info.sliding_windows))
                           for sid, t in kept.items()]
                want = [(m.key, m.upto) for m in ranked_matches(prompt, sources)]
                assert memory(i, prompt) == want


def test_an_entry_that_ends_on_a_block_boundary_serves_a_prompt_leaving_it_there():
    i = index()
    shared = list(range(2 * BLOCK))
    cached(i, shared + [900] * BLOCK, 1)  # hangs below the second block
    assert memory(i, shared + [901, 902]) == [(1, 2 * BLOCK)]
    assert memory(i, shared[:BLOCK] + [901]) == [(1, BLOCK)]
    assert memory(i, [901] + shared) == []


def test_entries_serve_their_own_scope_only():
    i = index()
    prompt = list(range(40))
    cached(i, prompt, 1, scope=Scope("a"))
    assert memory(i, prompt + [1], Scope("a")) == [(1, 40)]
    assert memory(i, prompt + [1], Scope("b")) == memory(i, prompt + [1], Scope("a", "salt")) == []


# ---- the memory tier: the prefix cache ----

def test_longest_match_beats_a_more_recent_shorter_one():
    i = index()
    cached(i, [1, 2, 3, 4, 5, 6], 1)
    cached(i, [1, 2, 3, 9], 2)
    assert memory(i, [1, 2, 3, 4, 5, 7, 8]) == [(1, 5), (2, 3)]


def test_ties_go_to_the_most_recent_entry():
    i = index()
    cached(i, [1, 2, 3, 4], 1)
    cached(i, [1, 2, 3, 5], 2)
    assert memory(i, [1, 2, 3, 6, 7])[0] == (2, 3)
    i.touch(i.best([1, 2, 3, 4, 9], Scope()).memory[0].entry)  # using the older one makes it the most recent
    assert memory(i, [1, 2, 3, 6, 7])[0] == (1, 3)


def test_a_match_leaves_the_last_prompt_token_to_run():
    i = index()
    cached(i, [1, 2, 3, 4], 1)
    assert memory(i, [1, 2, 3, 4]) == [(1, 3)]
    assert memory(i, [1, 2, 3, 4, 5]) == [(1, 4)]


def test_matches_shorter_than_the_minimum_are_not_used():
    i = index(min_tokens=3)
    cached(i, [1, 2, 8, 8], 1)
    assert memory(i, [1, 2, 9, 9]) == []


def test_the_same_prompt_again_refreshes_the_entry_and_is_not_kept():
    i = index(entries=2)
    cached(i, [1, 1], 1)
    cached(i, [2, 2], 2)
    assert cached(i, [1, 1], 3) == [3]  # the new copy is released; the first is now the most recent
    assert cached(i, [3, 3], 4) == [2]
    assert i.count("memory") == 2 and i.nbytes("memory") == 2


def test_eviction_by_entries_and_by_bytes():
    i = index(entries=2)
    assert cached(i, [1], 1) == [] and cached(i, [2], 2) == []
    assert cached(i, [3], 3) == [1]
    j = index(nbytes=10)
    cached(j, [1], 1, 4)
    cached(j, [2], 2, 4)
    assert cached(j, [3], 3, 4) == [1] and j.nbytes("memory") == 8
    assert cached(j, [4], 4, 11) == [4]  # could never fit: not kept


def test_evict_memory_frees_at_least_what_is_asked():
    i = index()
    for sid in range(4):
        cached(i, [sid], sid, 10)
    assert [e.sid for e in i.evict_memory(15)] == [0, 1]
    assert i.nbytes("memory") == 20


def test_a_lookup_less_what_gave_way_is_the_lookup_made_after():
    """The entries a prompt could start from give way last; what admission found before evicting, less what
    it evicted, is what the index finds after (placement starts from it: Request.found)."""
    i, prompt = index(), list(range(1, 40))
    for sid, n in enumerate((10, 20, 30)):
        cached(i, prompt[:n], sid, 10)
    cached(i, [99, 98], 3, 10)
    before = i.best(prompt, Scope(), disk=False)
    gone = i.evict_memory(25, before)
    assert [e.sid for e in gone] == [3, 0, 1]  # the one it does not start from first, then the oldest
    after = i.best(prompt, Scope(), disk=False)
    assert before.without(gone) == after and [m.entry.sid for m in after.memory] == [2]


def test_a_disabled_prefix_cache_keeps_nothing():
    i = index(entries=0)
    assert not i.worth_capturing(1000)
    assert cached(i, [1, 2], 1) == [1]


# ---- the other tiers ----

def test_files_and_donors_are_found_beside_the_memory_tier():
    i = index()
    prompt = list(range(50))
    cached(i, prompt[:20], 1)
    i.add_file(Entry("disk", i.digest(Scope()), tuple(prompt[:40]), "file", nbytes=100))
    i.run(7, prompt[:45] + [999], Scope(), admitted=7)
    found = i.best(prompt, Scope())
    assert found.cached == 20 and found.disk.upto == 40 and found.donor is None  # the donor committed nothing yet
    i.moved(7, 30, ())
    assert usable_match(prompt, i.best(prompt, Scope()).donor) == 30
    assert i.best(prompt, Scope(), disk=False).disk is None
    i.stop(7)
    assert i.best(prompt, Scope()).donor is None


def test_a_longer_file_covers_the_prompts_it_begins_with_where_any_prefix_clones():
    full, sliding = index(), index(info=SLIDING)
    for i in (full, sliding):
        i.add_file(Entry("disk", "s", tuple(range(30)), "long", nbytes=1))
    assert [e.owner for e in full.covering_files(range(20), "s")] == ["long"]
    assert sliding.covering_files(range(20), "s") == []  # a sliding window moved on: only its own prompt
    assert full.covering_files(range(20), "other") == []


class Heard:
    def __init__(self, seen: list, tier: str):
        self.seen, self.tier = seen, tier

    def stored(self, tokens, scope):
        self.seen.append(("+", self.tier, tuple(tokens), scope))

    def removed(self, tokens, scope):
        self.seen.append(("-", self.tier, tuple(tokens), scope))


def test_a_watcher_hears_every_entry_stored_and_removed():
    """Every store and every removal goes through one place, which tells the tier's watcher (KV events)."""
    seen: list = []
    i = index(entries=2)
    cached(i, [1], 1)
    for tier in ("memory", "disk", "running"):
        i.watch(tier, Heard(seen, tier))  # what is there already is told at once
    cached(i, [2], 2)
    cached(i, [2], 9)  # the same prompt again: refreshed, nothing stored
    cached(i, [3], 3)  # pushes [1] out
    i.add_file(Entry("disk", "s", (1,), "f"))
    i.add_file(Entry("disk", "s", (1,), "f2", nbytes=5))  # a newer file of the same entry takes its place
    i.evict_oldest("disk")
    i.run(5, [1, 2], Scope("t"), 5)
    i.stop(5)
    d, t = i.digest(Scope()), i.digest(Scope("t"))
    assert seen == [("+", "memory", (1,), d), ("+", "memory", (2,), d), ("+", "memory", (3,), d),
                    ("-", "memory", (1,), d), ("+", "disk", (1,), "s"), ("-", "disk", (1,), "s"),
                    ("+", "running", (1, 2), t), ("-", "running", (1, 2), t)]


# ---- prompts as long as agents send: the walks are iterative and linear in the blocks ----

class ListIndex:
    """The memory tier as a plain list, for reference: each entry compared token by token, the least
    recently used first out (no trie, no blocks)."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: list[tuple[tuple[int, ...], int, int]] = []  # (tokens, sid, nbytes), oldest first

    def keep(self, tokens, sid, nbytes) -> None:
        tokens = tuple(tokens)
        for at, held in enumerate(self.entries):
            if held[0] == tokens:  # the same prompt again: refreshed
                self.entries.append(self.entries.pop(at))
                return
        self.entries.append((tokens, sid, nbytes))
        while len(self.entries) > self.max_entries or self.nbytes > self.max_bytes:
            self.entries.pop(0)

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.entries)

    def best(self, prompt, min_tokens) -> tuple[int, int] | None:
        """(sid, upto) of the longest usable match, ties to the most recent; None under `min_tokens`."""
        best = None
        for tokens, sid, _ in self.entries:  # oldest first: a later tie replaces
            shared = 0
            while shared < min(len(tokens), len(prompt)) and tokens[shared] == prompt[shared]:
                shared += 1
            upto = min(shared, len(prompt) - 1)
            if upto >= min_tokens and (best is None or upto >= best[1]):
                best = (sid, upto)
        return best


def test_the_index_agrees_with_a_list_on_prompts_of_up_to_200k_tokens():
    """Random prompt sets of up to 200k tokens that share prefixes of every length, parting near their start,
    in their middle and near their end: the same best match and the same bytes as a plain list."""
    rng = random.Random(29)
    for round_ in range(6):
        i, ref = index(entries=6, nbytes=6 * 150_000, min_tokens=64), ListIndex(6, 6 * 150_000)
        base = [rng.randrange(1000) for _ in range(rng.choice((20_000, 64_000, 200_000)))]
        for sid in range(12):
            part = rng.choice((rng.randrange(0, 200), rng.randrange(len(base)), len(base) - rng.randrange(1, 200)))
            tail = [1000 + rng.randrange(1000) for _ in range(rng.randrange(0, 3 * BLOCK))]
            tokens = base[:part] + tail
            if not tokens:
                continue
            if rng.random() < 0.6:
                nbytes = len(tokens)
                cached(i, tokens, sid, nbytes=nbytes)
                ref.keep(tokens, sid, nbytes)
            else:
                best = memory(i, tokens)
                want = ref.best(tokens, 64)
                assert (best[0] if best else None) == want, (round_, sid, part)
            assert i.nbytes("memory") == ref.nbytes and i.count("memory") == len(ref.entries)


def test_each_walk_visits_nodes_linear_in_the_blocks_without_recursing(monkeypatch):
    """A cached prompt of 200k tokens and a new one leaving it after 40: the lookup sees the long entry
    below where they part (the walk that recursed once per block and raised RecursionError), visiting each
    node once; at a recursion limit just above the caller's, so no walk may recurse."""
    import inspect
    import sys

    from kvfork.server.engine.cache import index as index_module

    visits = 0

    class Children(dict):
        def values(self):
            nonlocal visits
            visits += 1
            return super().values()

        def items(self):
            nonlocal visits
            visits += 1
            return super().items()

    class Counted(index_module._Node):
        __slots__ = ()

        def __init__(self):
            super().__init__()
            self.children = Children()

    monkeypatch.setattr(index_module, "_Node", Counted)
    rng = random.Random(1)
    for length in (20_000, 200_000):
        i = index(entries=4, min_tokens=1)
        long = [rng.randrange(1000) for _ in range(length)]
        cached(i, long, 1)
        cached(i, long[:length // 2] + [5000] * 40, 2)
        blocks = length // BLOCK
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(len(inspect.stack(0)) + 60)
        try:
            visits = 0
            near_start = memory(i, long[:40] + [7000] * 100)
            visits_near_start, visits = visits, 0
            middle = memory(i, long[:length // 2 + 8] + [7001] * 100)
        finally:
            sys.setrecursionlimit(limit)
        assert near_start == [(2, 40), (1, 40)]  # both below where they part, ties to the most recent
        assert middle == [(1, length // 2 + 8), (2, length // 2)]
        assert visits_near_start <= blocks + 8 and visits <= blocks + 8, (length, visits_near_start, visits, blocks)
