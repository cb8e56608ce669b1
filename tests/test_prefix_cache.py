"""The prefix cache as a data structure: matching, recency, eviction."""

from server.engine.prefix_cache import PrefixCache


def cache(entries=16, nbytes=None, min_tokens=1) -> PrefixCache:
    return PrefixCache(entries, nbytes, min_tokens)


def test_longest_match_beats_a_more_recent_shorter_one():
    c = cache()
    c.insert([1, 2, 3, 4, 5, 6], "long", 6)
    c.insert([1, 2, 3, 9], "short", 4)
    matches = c.lookup([1, 2, 3, 4, 5, 7, 8])
    assert [(x.entry.session, x.upto) for x in matches] == [("long", 5), ("short", 3)]


def test_ties_go_to_the_most_recent_entry():
    c = cache()
    c.insert([1, 2, 3, 4], "older", 4)
    c.insert([1, 2, 3, 5], "newer", 4)
    assert c.lookup([1, 2, 3, 6, 7])[0].entry.session == "newer"
    c.touch(c.lookup([1, 2, 3, 4, 9])[0].entry)  # using "older" makes it the most recent
    assert c.lookup([1, 2, 3, 6, 7])[0].entry.session == "older"


def test_match_leaves_the_last_prompt_token_to_run():
    c = cache()
    c.insert([1, 2, 3, 4], "s", 4)
    assert c.lookup([1, 2, 3, 4])[0].upto == 3
    assert c.lookup([1, 2, 3, 4, 5])[0].upto == 4


def test_matches_shorter_than_the_minimum_are_not_used():
    c = cache(min_tokens=3)
    c.insert([1, 2, 8, 8], "s", 4)
    assert c.lookup([1, 2, 9, 9]) == []


def test_duplicate_insert_refreshes_recency_and_returns_the_copy():
    c = cache(entries=2)
    c.insert([1, 1], "a", 2)
    c.insert([2, 2], "b", 2)
    assert c.insert([1, 1], "a2", 2) == ["a2"]  # the new copy is released, "a" is now the most recent
    assert c.insert([3, 3], "c", 2) == ["b"]
    assert len(c) == 2 and c.nbytes == 4


def test_eviction_by_entries():
    c = cache(entries=2)
    assert c.insert([1], "a", 1) == [] and c.insert([2], "b", 1) == []
    assert c.insert([3], "c", 1) == ["a"]


def test_eviction_by_bytes():
    c = cache(nbytes=10)
    c.insert([1], "a", 4)
    c.insert([2], "b", 4)
    assert c.insert([3], "c", 4) == ["a"]
    assert c.nbytes == 8
    assert c.insert([4], "huge", 11) == ["huge"]  # could never fit: not stored


def test_evict_bytes_frees_at_least_what_is_asked():
    c = cache()
    for i in range(4):
        c.insert([i], str(i), 10)
    assert c.evict_bytes(15) == ["0", "1"]
    assert c.nbytes == 20
    assert sorted(c.clear()) == ["2", "3"] and c.nbytes == 0


def test_disabled_cache_keeps_nothing():
    c = cache(entries=0)
    assert not c.worth_capturing(1000)
    assert c.insert([1, 2], "s", 2) == ["s"]
