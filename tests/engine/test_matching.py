"""Prefix matching policy: clone-now's donor rule and the prefix-cache lookup, checked
against brute-force oracles over small token alphabets, plus named cases."""

from __future__ import annotations

import itertools
import random

import pytest

from kvfork.server.engine.policy.matching import (Recipient, Source, best_match, choose_reuse, common_prefix, ranked_matches,
                                    usable_match, window_floor)


def prompts(alphabet: int, max_len: int, min_len: int = 0) -> list[tuple[int, ...]]:
    return [p for n in range(min_len, max_len + 1) for p in itertools.product(range(alphabet), repeat=n)]


def naive_common_prefix(a, b) -> int:
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def oracle_best(prompt, donors: list[Source]):
    """Longest usable match first, then most recent: scan lengths downward instead of ranking."""
    for k in range(len(prompt) - 1, 0, -1):
        able = [d for d in donors if d.text and d.committed >= k and k >= d.clone_floor
                and len(d.tokens) >= k and tuple(d.tokens[:k]) == tuple(prompt[:k])]
        if able:
            return max(able, key=lambda d: d.recency).key, k
    return None


# ---- common_prefix ----

def test_common_prefix_all_short_pairs():
    seqs = prompts(2, 5)
    for a, b in itertools.product(seqs, seqs):
        assert common_prefix(a, b) == naive_common_prefix(a, b)
        assert common_prefix(list(a), b) == naive_common_prefix(a, b)


def test_common_prefix_long_sequences_diverging_everywhere():
    rng = random.Random(0)
    base = [rng.randrange(50_000) for _ in range(300)]
    for cut in range(len(base) + 1):
        other = base[:cut] + [50_001] + base[cut:]
        assert common_prefix(base, other) == cut
        assert common_prefix(other, base) == cut
        assert common_prefix(base, base[:cut]) == cut
        assert common_prefix(tuple(base), other) == cut
        for known in (0, cut // 2, cut):  # a length already known to be shared
            assert common_prefix(base, other, start=known) == cut


# ---- usable match ----

def test_usable_match_all_small_cases():
    for prompt, donor in itertools.product(prompts(2, 4, 1), prompts(2, 4)):
        for committed in range(0, len(donor) + 3):  # beyond the prompt: the donor is decoding
            expected = min(naive_common_prefix(prompt, donor), committed, len(prompt) - 1)
            assert usable_match(prompt, Source.donor("d", donor, committed, 0)) == expected


def test_committed_position_caps_the_match():
    prompt = list(range(100))
    assert usable_match(prompt + [7], Source.donor("d", prompt, 40, 0)) == 40


def test_prompt_length_minus_one_caps_the_match():
    # an identical prompt still runs its last token through the model for fresh logits
    prompt = list(range(100))
    assert usable_match(prompt, Source.donor("d", prompt, 100, 0)) == 99
    assert usable_match(prompt, Source.entry("e", prompt, 0)) == 99
    assert usable_match([5], Source.entry("e", [5], 0)) == 0


def test_generated_output_is_never_matched():
    # the donor decoded 3 tokens past its prompt; the recipient's prompt happens to contain them
    donor_prompt, output = [1, 2, 3], [4, 5, 6]
    donor = Source.donor("d", donor_prompt, committed=len(donor_prompt) + len(output), admitted=0)
    assert usable_match(donor_prompt + output + [9], donor) == 3


def test_non_text_donor_gives_nothing():
    assert usable_match([1, 2, 3], Source.donor("d", [1, 2, 3], 3, 0, text=False)) == 0


def test_window_floor_agrees_with_the_backend_refusal_rule():
    from kvfork.backends.base import KVCost, LayerAttention, ModelInfo, clone_refusal
    for window, position in itertools.product((1, 2, 4, 16), range(0, 40)):
        layers = (LayerAttention("full"), LayerAttention("sliding", window))
        info = ModelInfo("m", 10, 100, layers, (0,), KVCost(1), "f32", "cpu")
        held_from = [max(0, position - window)]  # a ring of exactly W positions
        servable = [u for u in range(1, position + 1) if clone_refusal(position, u, info, held_from) is None]
        floor = window_floor(position, [window])
        assert servable == list(range(max(1, floor), position + 1))
    assert window_floor(1000, []) == 0


def test_clone_floor_excludes_what_a_sliding_window_forgot():
    donor = Source.donor("d", list(range(50)), committed=50, admitted=0, clone_floor=49)
    assert usable_match(list(range(50)) + [1], donor) == 50
    assert usable_match(list(range(30)) + [99], donor) == 0


# ---- ranking: one rule for donors and cache entries ----

def test_best_match_against_oracle_all_small_cases():
    small = prompts(2, 3)
    for prompt in prompts(2, 3, 1):
        for (d1, c1), (d2, c2) in itertools.product(itertools.product(small, range(4)), repeat=2):
            for order in ((0, 1), (1, 0)):
                donors = [Source.donor("a", d1, c1, order[0]), Source.donor("b", d2, c2, order[1])]
                got = best_match(prompt, donors)
                want = oracle_best(prompt, donors)
                assert (got.key, got.upto) == want if got else want is None
                ranked = ranked_matches(prompt, donors)
                assert (ranked[0].key, ranked[0].upto) == want if ranked else want is None


def test_longest_match_beats_a_more_recent_shorter_one():
    prompt = list(range(20))
    old = Source.entry("old", prompt[:15], stamp=1)
    new = Source.entry("new", prompt[:10], stamp=2)
    assert best_match(prompt, [old, new]).key == "old"


def test_ties_go_to_the_most_recent():
    prompt = list(range(20))
    donors = [Source.donor(k, prompt[:12] + [999], 12, admitted) for k, admitted in (("x", 3), ("y", 7), ("z", 5))]
    assert best_match(prompt, donors).key == "y"
    assert [m.key for m in ranked_matches(prompt, donors)] == ["y", "z", "x"]


def test_ranked_matches_lists_every_fallback_in_order():
    # a refused clone falls back to the next entry: the whole ranking is there, zero matches left out
    prompt = [1, 2, 3, 4, 5, 6]
    entries = [Source.entry("a", [1, 2], 1), Source.entry("b", [1, 2, 3, 4], 2),
               Source.entry("c", [9, 9], 3), Source.entry("d", [1, 2], 4)]
    assert [(m.key, m.upto) for m in ranked_matches(prompt, entries)] == [("b", 4), ("d", 2), ("a", 2)]


# ---- clone-now at admission ----

def anonymous(prompt, request_id="r") -> Recipient:
    return Recipient(request_id, prompt)


def test_choose_reuse_threshold_all_small_cases():
    # donor_match d and cached match c, for every threshold: donor iff enabled and d - c >= min
    prompt = list(range(8))
    for d, c, min_tokens in itertools.product(range(8), range(8), range(4)):
        donors = [Source.donor("d", prompt[:d] + [99], d, 0)] if d else []
        choice = choose_reuse(anonymous(prompt), donors, cached=c, min_tokens=min_tokens)
        if min_tokens > 0 and d > 0 and d - c >= min_tokens:
            assert (choice.kind, choice.donor, choice.upto) == ("donor", "d", d)
        elif c > 0:
            assert (choice.kind, choice.donor, choice.upto) == ("cache", None, c)
        else:
            assert (choice.kind, choice.donor, choice.upto) == ("none", None, 0)
        assert (choice.cached_match, choice.min_tokens) == (c, min_tokens)
        assert choice.donor_match == (d if min_tokens > 0 else 0)


def test_zero_disables_active_reuse():
    prompt = list(range(50))
    donors = [Source.donor("d", prompt, 50, 0)]
    choice = choose_reuse(anonymous(prompt), donors, cached=0, min_tokens=0)
    assert (choice.kind, choice.reason) == ("none", "disabled")
    assert choose_reuse(anonymous(prompt), donors, cached=10, min_tokens=0).kind == "cache"


def test_threshold_is_measured_against_the_cached_match():
    prompt = list(range(2000))
    donors = [Source.donor("d", prompt, 1800, 0)]
    # saves 1800 over nothing, but only 800 over a 1000-token cached prefix
    assert choose_reuse(anonymous(prompt), donors, cached=0, min_tokens=1024).kind == "donor"
    below = choose_reuse(anonymous(prompt), donors, cached=1000, min_tokens=1024)
    assert (below.kind, below.upto, below.reason, below.donor_match) == ("cache", 1000, "below_threshold", 1800)
    assert choose_reuse(anonymous(prompt), donors, cached=776, min_tokens=1024).kind == "donor"


def test_equally_useful_cached_prefix_wins():
    prompt = list(range(100))
    donors = [Source.donor("d", prompt, 100, 0)]
    choice = choose_reuse(anonymous(prompt), donors, cached=99, min_tokens=1)
    assert (choice.kind, choice.upto, choice.reason) == ("cache", 99, "cache_wins")


def test_named_session_recipients_are_untouched():
    prompt = list(range(100))
    donors = [Source.donor("d", prompt, 100, 0)]
    choice = choose_reuse(Recipient("r", prompt, session_id="chat-1"), donors, cached=50, min_tokens=1)
    assert (choice.kind, choice.upto, choice.donor, choice.reason) == ("none", 0, None, "named_session")


def test_multimodal_recipients_are_untouched():
    prompt = list(range(100))
    choice = choose_reuse(Recipient("r", prompt, text=False), [Source.donor("d", prompt, 100, 0)], 50, 1)
    assert (choice.kind, choice.reason) == ("none", "not_text")


def test_named_donor_can_serve_an_anonymous_recipient():
    # any active text request is a donor: the view carries no session, so nothing can bar it
    prompt = list(range(30))
    choice = choose_reuse(anonymous(prompt), [Source.donor("named", prompt, 30, 0)], 0, 1)
    assert (choice.kind, choice.donor, choice.upto) == ("donor", "named", 29)


def test_recipient_is_never_its_own_donor():
    prompt = list(range(30))
    choice = choose_reuse(anonymous(prompt, "me"), [Source.donor("me", prompt, 30, 0)], 0, 1)
    assert (choice.kind, choice.reason) == ("none", "no_donor")


def test_donor_selection_longest_then_most_recent():
    prompt = list(range(40))
    donors = [Source.donor("long-old", prompt[:30], 30, 1), Source.donor("short-new", prompt[:20], 20, 9),
              Source.donor("long-new", prompt[:30] + [7], 30, 5), Source.donor("still-prefilling", prompt, 25, 8)]
    choice = choose_reuse(anonymous(prompt), donors, 0, 1)
    assert (choice.donor, choice.upto) == ("long-new", 30)


@pytest.mark.parametrize("cached", [0, 5])
def test_log_fields_explain_the_choice(cached):
    prompt = list(range(40))
    choice = choose_reuse(anonymous(prompt), [Source.donor("d", prompt, 20, 0)], cached, 4)
    assert choice.log_fields() == {"reuse": "donor", "reuse_upto": 20, "donor": "d", "donor_match": 20,
                                   "cached_match": cached, "reuse_min_tokens": 4, "reuse_reason": "donor"}


def test_a_recurrent_source_serves_only_the_positions_it_holds():
    """A state with recurrent layers is matched at the highest held position at or below the usable match
    (its own position, or a checkpoint: backends.base.clone_positions), never anywhere between."""
    prompt = list(range(100))
    donor = Source.donor("d", prompt[:80], committed=60, admitted=1, positions=(20, 45, 60))
    assert usable_match(prompt, donor) == 60
    assert usable_match(prompt[:50] + [-1] * 10, donor) == 45  # leaves it at 50: the checkpoint at 45
    assert usable_match(prompt[:19] + [-1] * 10, donor) == 0  # below every state it holds
    assert usable_match(prompt[:61], donor) == 60  # len - 1 == 60: its position
    entry = Source.entry("e", tuple(prompt[:39]), 0, positions=(39,))
    assert usable_match(prompt[:40], entry) == 39  # the same prompt again: the len - 1 snapshot
    assert usable_match(prompt[:38] + [-1], entry) == 0
