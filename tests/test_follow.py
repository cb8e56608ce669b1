"""Follow-the-leader policy: the cost model's choices and leader election."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest

from kvfork.server.engine.follow import FollowDecision, FollowPolicy, FollowOrder, Leader, leader_views
from kvfork.server.engine import follow as following
from kvfork.server.engine.matching import Recipient, Source, choose_reuse, common_prefix
from kvfork.server.engine.rates import Rates


def decide(recipient: Recipient, leaders: list[Leader], cached: int, rates: Rates, policy: FollowPolicy,
           prefilling: int) -> FollowDecision:
    """follow.decide with clone-now's choice over the leaders' sources, as placement makes it from the index."""
    now = choose_reuse(recipient, [lead.source for lead in leaders], cached, policy.min_tokens)
    return following.decide(recipient, leaders, now, rates, policy, prefilling)

FREE_CLONES = Rates(prefill_tps=100.0, clone_fixed_s=0.0, clone_s_per_token=0.0)
ON = FollowPolicy(min_tokens=1, follow=True, max_wait_s=math.inf)


def active(key, prompt, committed, admitted=0, tps=100.0) -> Leader:
    return Leader.active(Source.donor(key, prompt, committed, admitted), tps)


# ---- the cost model's choices ----

def test_follows_a_leader_still_prefilling_the_shared_part():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=200)
    p = decide(Recipient("b", shared + [2]), [lead], cached=0, rates=Rates(prefill_tps=100.0), policy=ON, prefilling=1)
    assert (p.follow, p.leader, p.target, p.reason) == (True, "a", 1000, "follow")
    assert p.wait_s == pytest.approx(8.0)  # 800 tokens at 100 tok/s
    # clone-now's choice it beat: clone the 200 committed now and prefill 801 sharing the rate with the leader
    assert (p.now.kind, p.now.upto) == ("donor", 200)
    rates = Rates(prefill_tps=100.0)
    assert p.ttft_now_s == p.ttft_clone_s == pytest.approx(rates.clone_s(200) + 801 / 50)
    assert p.ttft_alone_s == pytest.approx(1001 / 50)
    assert p.ttft_follow_s == pytest.approx(8.0 + rates.clone_s(1000) + 1 / 50)


def test_a_slow_leader_loses_to_cloning_what_is_committed_now():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=200, tps=1.0)  # barely moving: e.g. starved of budget
    p = decide(Recipient("b", shared + [2]), [lead], 0, Rates(prefill_tps=100.0), ON, prefilling=1)
    assert (p.follow, p.reason, p.now.kind, p.now.upto) == (False, "slower", "donor", 200)
    assert p.ttft_follow_s > p.ttft_now_s


def test_a_costly_clone_loses_to_going_alone():
    shared = list(range(100))
    lead = active("a", shared + [1], committed=0)
    slow_clone = Rates(prefill_tps=100.0, clone_fixed_s=50.0, clone_s_per_token=0.0)
    p = decide(Recipient("b", shared + [2]), [lead], 0, slow_clone, ON, prefilling=1)
    assert (p.follow, p.reason, p.now.kind) == (False, "slower", "none")


def test_follow_max_wait_bounds_the_wait():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=0)  # 10 s to commit the shared part
    for max_wait, follow in ((9.99, False), (10.0, True)):
        policy = FollowPolicy(min_tokens=1, max_wait_s=max_wait)
        p = decide(Recipient("b", shared + [2]), [lead], 0, Rates(prefill_tps=100.0), policy, prefilling=1)
        assert p.follow is follow
        assert p.reason == ("follow" if follow else "too_long")


def test_follow_must_beat_the_cached_match_by_min_tokens():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=0, tps=1e9)  # so fast that only the threshold decides
    for cached, follow in ((0, True), (900, True), (901, False)):
        policy = FollowPolicy(min_tokens=100, max_wait_s=math.inf)
        p = decide(Recipient("b", shared + [2]), [lead], cached, FREE_CLONES, policy, prefilling=1)
        assert p.follow is follow
        if not follow:
            assert (p.reason, p.now.kind, p.now.upto) == ("below_threshold", "cache", 901)


def test_nothing_to_wait_for_when_the_leader_has_committed_the_match():
    shared = list(range(100))
    lead = active("a", shared + [1], committed=101)  # decoding: clone-now clones at once
    p = decide(Recipient("b", shared + [2]), [lead], 0, FREE_CLONES, ON, prefilling=0)
    assert (p.follow, p.reason, p.now.kind, p.now.donor, p.now.upto) == (False, "no_leader", "donor", "a", 100)


def test_a_leader_past_the_match_is_not_followed_even_when_its_window_forgot_it():
    shared = list(range(100))
    # decoding at 120 with a sliding window: it can serve only upto >= 119, so nothing now
    lead = Leader.active(Source.donor("a", shared + [1], 120, 0, clone_floor=119), tps=100.0)
    p = decide(Recipient("b", shared + [2]), [lead], 0, FREE_CLONES, ON, prefilling=0)
    assert (p.follow, p.reason, p.now.kind) == (False, "no_leader", "none")


def test_generated_output_is_not_a_follow_target():
    prompt, output = [1, 2, 3], [4, 5, 6, 7]
    lead = active("a", prompt, committed=3)  # will decode `output`, which is not its prompt
    p = decide(Recipient("b", prompt + output + [9]), [lead], 0, FREE_CLONES, ON, prefilling=0)
    assert (p.follow, p.now.upto) == (False, 3)


@pytest.mark.parametrize("recipient", [Recipient("b", list(range(50)), session_id="s"),
                                       Recipient("b", list(range(50)), text=False)])
def test_named_and_multimodal_recipients_never_follow(recipient):
    p = decide(recipient, [active("a", list(range(60)), 0)], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.follow, p.reason, p.now.kind) == (False, "off", "none")


def test_zero_min_tokens_disables_following_too():
    p = decide(Recipient("b", list(range(50))), [active("a", list(range(60)), 0)], 0, FREE_CLONES,
             FollowPolicy(min_tokens=0), prefilling=1)
    assert (p.follow, p.reason, p.now.reason) == (False, "off", "disabled")


def test_no_follow_gives_exactly_the_seed_choice_all_small_cases():
    seqs = [p for n in range(1, 4) for p in itertools.product(range(2), repeat=n)]
    for prompt, d1, d2 in itertools.product(seqs, repeat=3):
        leaders = [active("x", d1, len(d1) - 1, 1), active("y", d2, 1, 2)]
        for cached, min_tokens in itertools.product(range(3), range(3)):
            p = decide(Recipient("r", prompt), leaders, cached, FREE_CLONES,
                     FollowPolicy(min_tokens, follow=False), prefilling=2)
            assert not p.follow
            assert p.now == choose_reuse(Recipient("r", prompt), [lead.source for lead in leaders], cached, min_tokens)


def test_every_follow_decision_keeps_the_rules_random_cases():
    rng = random.Random(11)
    for _ in range(3000):
        base = [rng.randrange(2) for _ in range(8)]

        def prompt():
            return base[:rng.randrange(0, 9)] + [rng.randrange(2) for _ in range(rng.randrange(1, 3))]

        leaders = [Leader.starting(Source.donor(k, prompt(), rng.randrange(3), k), rng.randrange(9),
                                   rng.random() * 3, rng.choice((0.0, 0.5, 2.0, 8.0))) for k in range(3)]
        rates = Rates(rng.choice((1.0, 4.0)), rng.choice((0.0, 0.3)), rng.choice((0.0, 0.05)))
        policy = FollowPolicy(rng.randrange(3), max_wait_s=rng.choice((0.5, 2.0, math.inf)))
        recipient, cached = Recipient("r", prompt()), rng.randrange(3)
        p = decide(recipient, leaders, cached, rates, policy, prefilling=rng.randrange(3))
        assert p.now == choose_reuse(recipient, [lead.source for lead in leaders], cached, policy.min_tokens)
        if not p.follow:
            continue
        lead = next(lead for lead in leaders if lead.source.key == p.leader)
        assert p.target == min(common_prefix(recipient.prompt, lead.source.tokens), len(recipient.prompt) - 1)
        assert p.target > max(p.now.upto, lead.source.committed) and p.target - cached >= policy.min_tokens
        assert p.wait_s == lead.eta(p.target) <= policy.max_wait_s
        assert p.ttft_follow_s <= p.ttft_now_s * (1 + 1e-9)
        # no other leader within the wait offers a longer match
        for other in leaders:
            m = min(common_prefix(recipient.prompt, other.source.tokens), len(recipient.prompt) - 1)
            if m > max(p.now.upto, other.source.committed) and other.eta(m) <= policy.max_wait_s:
                assert m <= p.target


def test_log_fields_carry_the_inputs():
    shared = list(range(100))
    p = decide(Recipient("b", shared + [2]), [active("a", shared + [1], 0)], 0, Rates(prefill_tps=100.0), ON, 1)
    fields = p.log_fields()
    assert fields["follow"] is True and fields["leader"] == "a" and fields["follow_target"] == 100
    assert fields["prefill_tps"] == 100.0 and fields["prefilling"] == 1 and fields["reuse"] == "none"
    assert fields["ttft_follow_s"] <= fields["ttft_alone_s"] and fields["ttft_clone_s"] is None


# ---- leader election ----

def test_longest_eventual_match_is_the_leader():
    shared = list(range(100))
    leaders = [active("short-early", shared[:50] + [7], 0, admitted=1),
               active("long-late", shared + [8], 0, admitted=2)]
    p = decide(Recipient("r", shared + [9]), leaders, 0, FREE_CLONES, ON, prefilling=2)
    assert (p.leader, p.target) == ("long-late", 100)


def test_equal_matches_elect_the_one_there_soonest_then_the_earliest():
    shared = list(range(100))
    ahead = active("ahead", shared + [1], 60, admitted=5)
    behind = active("behind", shared + [2], 10, admitted=1)
    p = decide(Recipient("r", shared + [3]), [behind, ahead], 0, FREE_CLONES, ON, prefilling=2)
    assert p.leader == "ahead"
    twins = [active("late", shared + [1], 10, admitted=5), active("early", shared + [2], 10, admitted=1)]
    assert decide(Recipient("r", shared + [3]), twins, 0, FREE_CLONES, ON, prefilling=2).leader == "early"


def test_a_parked_follower_leads_what_only_it_will_prefill():
    # a: S + x; b follows a for S and will prefill S + T itself; c shares S + T with b
    s, t = list(range(50)), list(range(100, 150))
    a = active("a", s + [1], 0, admitted=1, tps=100.0)
    b_source = Source.donor("b", s + t + [2], 0, 2)
    b = Leader.starting(b_source, at=50, after_s=a.eta(50), tps=100.0)
    p = decide(Recipient("c", s + t + [3]), [a, b], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.leader, p.target) == ("b", 100)
    assert p.wait_s == pytest.approx(a.eta(50) + 50 / 100.0)
    # but for the part only a prefills, a parked follower never beats a
    p = decide(Recipient("d", s + [4]), [a, b], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.leader, p.target) == ("a", 50)


def test_leader_eta():
    lead = Leader.starting(Source.donor("x", list(range(100)), 0, 0), at=40, after_s=2.0, tps=10.0)
    assert [lead.eta(0), lead.eta(1), lead.eta(40), lead.eta(50)] == [0.0, 2.0, 2.0, 3.0]
    stuck = Leader.active(Source.donor("y", list(range(100)), 5, 0), tps=0.0)
    assert stuck.eta(5) == 0.0 and stuck.eta(6) == math.inf


def test_leader_views_see_parked_followers_down_a_chain():
    rates = Rates(prefill_tps=10.0, clone_fixed_s=1.0, clone_s_per_token=0.0)
    a = active("a", list(range(100)), committed=20, tps=10.0)
    b = FollowOrder("b", "a", target=40, order=1, deadline=math.inf)  # a reaches 40 in 2 s, clone 1 s
    c = FollowOrder("c", "b", target=60, order=2, deadline=math.inf)  # b reaches 60 at 3 + 2 s, clone 1 s
    orphan = FollowOrder("d", "not-a-leader", target=5, order=3, deadline=math.inf)
    views = leader_views([a], [(f, Source.donor(f.request_id, list(range(100)), 0, f.order)) for f in (b, c, orphan)],
                         rates, tps=10.0)
    assert [v.source.key for v in views] == ["a", "b", "c", "d"]
    assert [v.follows for v in views] == [None, "a", "b", "not-a-leader"]
    assert [v.eta(40) for v in views[:2]] == [2.0, 3.0]
    assert views[2].eta(60) == 6.0 and views[2].eta(70) == 7.0
    assert views[3].eta(5) == math.inf


def test_scanning_followers_through_their_leaders_changes_no_plan():
    # decide skips comparing a parked follower's shared part with its leader's; the
    # same views without `follows` compare every prompt in full, and must agree
    rng = random.Random(3)
    for _ in range(400):
        base = [rng.randrange(2) for _ in range(10)]
        prompts = [base[:rng.randrange(1, 11)] + [rng.randrange(2) for _ in range(rng.randrange(3))] for _ in range(7)]
        active = [Leader.active(Source.donor(0, prompts[0], rng.randrange(len(prompts[0]) + 1), 0), 3.0)]
        parked = []
        for j in range(1, 6):
            lead = rng.randrange(j)
            target = min(common_prefix(prompts[j], prompts[lead]), len(prompts[j]) - 1)
            if target > 0:
                parked.append((FollowOrder(j, lead, target, j, math.inf), Source.donor(j, prompts[j], 0, j)))
        views = leader_views(active, parked, FREE_CLONES, 3.0)
        assert all(v.follows is not None for v in views[1:])
        blind = [replace(v, follows=None) for v in views]
        recipient = Recipient(6, prompts[6])
        assert decide(recipient, views, 0, FREE_CLONES, ON, 1) == decide(recipient, blind, 0, FREE_CLONES, ON, 1)


# ---- at a follower's deadline: go on following while it is cheaper ----

from kvfork.server.engine.follow import at_deadline  # noqa: E402


def test_at_the_deadline_a_follower_of_a_moving_leader_keeps_following():
    # issue 23's loaded machine: 59 tok/s, half of a 2,040-token prompt committed after 30 s
    rates = Rates(prefill_tps=59.0)
    moving = at_deadline(2040, 2039, 1024, progress_tps=59.0, rates=rates, prefilling=1, max_wait_s=30.0)
    assert moving.keep and moving.ttft_follow_s < moving.ttft_now_s
    assert moving.recheck_s == 30.0  # it looks again within --follow-max-wait
    near = at_deadline(2040, 2039, 2000, progress_tps=59.0, rates=rates, prefilling=1, max_wait_s=30.0)
    assert near.keep and near.recheck_s == 30.0


def test_at_the_deadline_a_follower_of_a_stalled_leader_stops_and_one_of_a_crawling_leader_does_not():
    rates = Rates(prefill_tps=59.0)
    stalled = at_deadline(2040, 2039, 1024, progress_tps=0.0, rates=rates, prefilling=1, max_wait_s=30.0)
    assert not stalled.keep and stalled.ttft_follow_s == math.inf
    # a leader moving at 5 tok/s: the machine is that slow for the follower too, so following still wins
    crawling = at_deadline(2040, 2039, 1024, progress_tps=5.0, rates=rates, prefilling=1, max_wait_s=30.0)
    assert crawling.keep and crawling.ttft_now_s == pytest.approx(rates.clone_s(1024) + 1016 / 2.5)


def test_at_the_deadline_a_follower_a_few_tokens_short_of_its_target_clones_now():
    rates = Rates(prefill_tps=1000.0, clone_fixed_s=0.002, clone_s_per_token=0.001)
    near = at_deadline(2040, 1030, 1024, progress_tps=1000.0, rates=rates, prefilling=1, max_wait_s=30.0)
    assert not near.keep  # cloning 6 more tokens costs more than prefilling them
