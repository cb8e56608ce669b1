"""Follow-the-leader policy: cost model choices, leader election, promotion, chunk stops.

The burst tests run a step simulator over every small burst: each prefilling
request commits `chunk` tokens a step, clones land between steps. They assert
that no shared token is ever prefilled twice, that cancelling a leader (or a
follower) at any step leaves every other request with its whole prompt
computed, and that nobody waits forever.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from server.engine.follow import (FollowPolicy, Following, Leader, Promotion, chunk_end, leader_views, plan,
                                  promote)
from server.engine.matching import Recipient, Source, choose_reuse, common_prefix
from server.engine.rates import Rates, RateTracker

FREE_CLONES = Rates(prefill_tps=100.0, clone_fixed_s=0.0, clone_s_per_token=0.0)
ON = FollowPolicy(min_tokens=1, follow=True, max_wait_s=math.inf)


def active(key, prompt, committed, admitted=0, tps=100.0) -> Leader:
    return Leader.active(Source.donor(key, prompt, committed, admitted), tps)


# ---- the cost model's choices ----

def test_follows_a_leader_still_prefilling_the_shared_part():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=200)
    p = plan(Recipient("b", shared + [2]), [lead], cached=0, rates=Rates(prefill_tps=100.0), policy=ON, prefilling=1)
    assert (p.follow, p.leader, p.target, p.reason) == (True, "a", 1000, "follow")
    assert p.wait_s == pytest.approx(8.0)  # 800 tokens at 100 tok/s
    # the seed's choice it beat: clone the 200 committed now and prefill 801 sharing the rate with the leader
    assert (p.now.kind, p.now.upto) == ("donor", 200)
    rates = Rates(prefill_tps=100.0)
    assert p.ttft_now_s == p.ttft_clone_s == pytest.approx(rates.clone_s(200) + 801 / 50)
    assert p.ttft_alone_s == pytest.approx(1001 / 50)
    assert p.ttft_follow_s == pytest.approx(8.0 + rates.clone_s(1000) + 1 / 50)


def test_a_slow_leader_loses_to_cloning_what_is_committed_now():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=200, tps=1.0)  # barely moving: e.g. starved of budget
    p = plan(Recipient("b", shared + [2]), [lead], 0, Rates(prefill_tps=100.0), ON, prefilling=1)
    assert (p.follow, p.reason, p.now.kind, p.now.upto) == (False, "slower", "donor", 200)
    assert p.ttft_follow_s > p.ttft_now_s


def test_a_costly_clone_loses_to_going_alone():
    shared = list(range(100))
    lead = active("a", shared + [1], committed=0)
    slow_clone = Rates(prefill_tps=100.0, clone_fixed_s=50.0, clone_s_per_token=0.0)
    p = plan(Recipient("b", shared + [2]), [lead], 0, slow_clone, ON, prefilling=1)
    assert (p.follow, p.reason, p.now.kind) == (False, "slower", "none")


def test_follow_max_wait_bounds_the_wait():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=0)  # 10 s to commit the shared part
    for max_wait, follow in ((9.99, False), (10.0, True)):
        policy = FollowPolicy(min_tokens=1, max_wait_s=max_wait)
        p = plan(Recipient("b", shared + [2]), [lead], 0, Rates(prefill_tps=100.0), policy, prefilling=1)
        assert p.follow is follow
        assert p.reason == ("follow" if follow else "too_long")


def test_follow_must_beat_the_cached_match_by_min_tokens():
    shared = list(range(1000))
    lead = active("a", shared + [1], committed=0, tps=1e9)  # so fast that only the threshold decides
    for cached, follow in ((0, True), (900, True), (901, False)):
        policy = FollowPolicy(min_tokens=100, max_wait_s=math.inf)
        p = plan(Recipient("b", shared + [2]), [lead], cached, FREE_CLONES, policy, prefilling=1)
        assert p.follow is follow
        if not follow:
            assert (p.reason, p.now.kind, p.now.upto) == ("below_threshold", "cache", 901)


def test_nothing_to_wait_for_when_the_leader_has_committed_the_match():
    shared = list(range(100))
    lead = active("a", shared + [1], committed=101)  # decoding: the seed's rule clones at once
    p = plan(Recipient("b", shared + [2]), [lead], 0, FREE_CLONES, ON, prefilling=0)
    assert (p.follow, p.reason, p.now.kind, p.now.donor, p.now.upto) == (False, "no_leader", "donor", "a", 100)


def test_generated_output_is_not_a_follow_target():
    prompt, output = [1, 2, 3], [4, 5, 6, 7]
    lead = active("a", prompt, committed=3)  # will decode `output`, which is not its prompt
    p = plan(Recipient("b", prompt + output + [9]), [lead], 0, FREE_CLONES, ON, prefilling=0)
    assert (p.follow, p.now.upto) == (False, 3)


@pytest.mark.parametrize("recipient", [Recipient("b", list(range(50)), session_id="s"),
                                       Recipient("b", list(range(50)), text=False)])
def test_named_and_multimodal_recipients_never_follow(recipient):
    p = plan(recipient, [active("a", list(range(60)), 0)], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.follow, p.reason, p.now.kind) == (False, "off", "none")


def test_zero_min_tokens_disables_following_too():
    p = plan(Recipient("b", list(range(50))), [active("a", list(range(60)), 0)], 0, FREE_CLONES,
             FollowPolicy(min_tokens=0), prefilling=1)
    assert (p.follow, p.reason, p.now.reason) == (False, "off", "disabled")


def test_no_follow_gives_exactly_the_seed_choice_all_small_cases():
    seqs = [p for n in range(1, 4) for p in itertools.product(range(2), repeat=n)]
    for prompt, d1, d2 in itertools.product(seqs, repeat=3):
        leaders = [active("x", d1, len(d1) - 1, 1), active("y", d2, 1, 2)]
        for cached, min_tokens in itertools.product(range(3), range(3)):
            p = plan(Recipient("r", prompt), leaders, cached, FREE_CLONES,
                     FollowPolicy(min_tokens, follow=False), prefilling=2)
            assert not p.follow
            assert p.now == choose_reuse(Recipient("r", prompt), [lead.source for lead in leaders], cached, min_tokens)


def test_log_fields_carry_the_inputs():
    shared = list(range(100))
    p = plan(Recipient("b", shared + [2]), [active("a", shared + [1], 0)], 0, Rates(prefill_tps=100.0), ON, 1)
    fields = p.log_fields()
    assert fields["follow"] is True and fields["leader"] == "a" and fields["follow_target"] == 100
    assert fields["prefill_tps"] == 100.0 and fields["prefilling"] == 1 and fields["reuse"] == "none"
    assert fields["ttft_follow_s"] <= fields["ttft_alone_s"] and fields["ttft_clone_s"] is None


# ---- leader election ----

def test_longest_eventual_match_is_the_leader():
    shared = list(range(100))
    leaders = [active("short-early", shared[:50] + [7], 0, admitted=1), active("long-late", shared + [8], 0, admitted=2)]
    p = plan(Recipient("r", shared + [9]), leaders, 0, FREE_CLONES, ON, prefilling=2)
    assert (p.leader, p.target) == ("long-late", 100)


def test_equal_matches_elect_the_one_there_soonest_then_the_earliest():
    shared = list(range(100))
    ahead = active("ahead", shared + [1], 60, admitted=5)
    behind = active("behind", shared + [2], 10, admitted=1)
    p = plan(Recipient("r", shared + [3]), [behind, ahead], 0, FREE_CLONES, ON, prefilling=2)
    assert p.leader == "ahead"
    twins = [active("late", shared + [1], 10, admitted=5), active("early", shared + [2], 10, admitted=1)]
    assert plan(Recipient("r", shared + [3]), twins, 0, FREE_CLONES, ON, prefilling=2).leader == "early"


def test_a_parked_follower_leads_what_only_it_will_prefill():
    # a: S + x; b follows a for S and will prefill S + T itself; c shares S + T with b
    s, t = list(range(50)), list(range(100, 150))
    a = active("a", s + [1], 0, admitted=1, tps=100.0)
    b_source = Source.donor("b", s + t + [2], 0, 2)
    b = Leader.starting(b_source, at=50, after_s=a.eta(50), tps=100.0)
    p = plan(Recipient("c", s + t + [3]), [a, b], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.leader, p.target) == ("b", 100)
    assert p.wait_s == pytest.approx(a.eta(50) + 50 / 100.0)
    # but for the part only a prefills, a parked follower never beats a
    p = plan(Recipient("d", s + [4]), [a, b], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.leader, p.target) == ("a", 50)


def test_leader_eta():
    lead = Leader.starting(Source.donor("x", list(range(100)), 0, 0), at=40, after_s=2.0, tps=10.0)
    assert [lead.eta(0), lead.eta(1), lead.eta(40), lead.eta(50)] == [0.0, 2.0, 2.0, 3.0]
    stuck = Leader.active(Source.donor("y", list(range(100)), 5, 0), tps=0.0)
    assert stuck.eta(5) == 0.0 and stuck.eta(6) == math.inf


def test_leader_views_see_parked_followers_down_a_chain():
    rates = Rates(prefill_tps=10.0, clone_fixed_s=1.0, clone_s_per_token=0.0)
    a = active("a", list(range(100)), committed=20, tps=10.0)
    b = Following("b", "a", target=40, order=1, deadline=math.inf)  # a reaches 40 in 2 s, clone 1 s
    c = Following("c", "b", target=60, order=2, deadline=math.inf)  # b reaches 60 at 3 + 2 s, clone 1 s
    orphan = Following("d", "not-a-leader", target=5, order=3, deadline=math.inf)
    views = leader_views([a], [(f, Source.donor(f.request_id, list(range(100)), 7, f.order)) for f in (b, c, orphan)],
                         rates, tps=10.0)
    assert [v.source.key for v in views] == ["a", "b", "c", "d"]
    assert [v.source.committed for v in views] == [20, 0, 0, 0]  # a parked follower holds nothing yet
    assert [v.eta(40) for v in views[:2]] == [2.0, 3.0]
    assert views[2].eta(60) == 6.0 and views[2].eta(70) == 7.0
    assert views[3].eta(5) == math.inf


# ---- parking, chunk stops, promotion ----

def test_following_ready_and_deadline():
    shared = list(range(100))
    p = plan(Recipient("b", shared + [2]), [active("a", shared + [1], 0)], 0, FREE_CLONES, ON, 1)
    f = Following.park("b", p, order=3, first_parked_at=10.0, max_wait_s=5.0)
    assert (f.leader, f.target, f.deadline) == ("a", 100, 15.0)
    assert not f.ready(99) and f.ready(100) and f.ready(150)
    assert not f.expired(14.9) and f.expired(15.0)


def test_chunk_end_stops_at_follower_targets():
    assert chunk_end(0, 512, []) == 512
    assert chunk_end(0, 512, [300, 100, 700]) == 100
    assert chunk_end(100, 512, [100, 512]) == 512  # reached, or the chunk ends there anyway
    assert chunk_end(100, 512, [101]) == 101


def follower(rid, target, order, leader="gone") -> Following:
    return Following(rid, leader, target, order, math.inf)


def test_promotion_heir_salvages_most_then_earliest():
    parked = [follower("f3", 900, 3), follower("f1", 100, 1), follower("f2", 900, 2), follower("other", 5, 0, "x")]
    promo = promote("gone", 600, parked)
    assert (promo.heir, promo.upto, promo.replan) == ("f2", 600, ("f1", "f3"))
    promo = promote("gone", 50, parked)  # all salvage 50: the earliest takes over
    assert (promo.heir, promo.upto, promo.replan) == ("f1", 50, ("f2", "f3"))


def test_promotion_replans_the_whole_tree_below_except_the_heirs():
    parked = [follower("f1", 100, 1), follower("f2", 50, 2),
              follower("c1", 120, 5, leader="f1"), follower("c2", 60, 4, leader="f2"),
              follower("g2", 70, 3, leader="c2"), follower("x", 9, 0, leader="elsewhere")]
    promo = promote("gone", 100, parked)
    assert (promo.heir, promo.upto, promo.replan) == ("f1", 100, ("f2", "g2", "c2"))


def test_promotion_with_nothing_to_salvage_replans_everyone_in_order():
    parked = [follower("f2", 10, 2), follower("f1", 10, 1), follower("c", 10, 3, leader="f2")]
    assert promote("gone", 0, parked) == promote("gone", 500, parked, state_usable=False)
    assert promote("gone", 0, parked) == Promotion(None, 0, ("f1", "f2", "c"))
    assert promote("gone", 500, []) == Promotion(None, 0, ())


# ---- burst simulator ----

@dataclass
class Sim:
    prompts: list[tuple[int, ...]]
    chunk: int
    committed: dict[int, int] = field(default_factory=dict)  # prefilling or done, by request index
    parked: dict[int, Following] = field(default_factory=dict)
    prefilled: list[list[tuple[int, int]]] = field(default_factory=list)  # ranges each request computed
    gone: set[int] = field(default_factory=set)

    def __post_init__(self):
        self.prefilled = [[] for _ in self.prompts]

    def admit(self, i: int) -> None:
        # time unit = one step; the recipient would prefill `chunk` tokens a step like everyone
        tps = float(self.chunk)
        active = [Leader.active(Source.donor(j, self.prompts[j], c, j), tps) for j, c in self.committed.items()]
        parked = [(f, Source.donor(j, self.prompts[j], 0, j)) for j, f in self.parked.items()]
        leaders = leader_views(active, parked, FREE_CLONES, tps)
        p = plan(Recipient(i, self.prompts[i]), leaders, 0, Rates(self.chunk * (len(self.committed) + 1), 0, 0),
                 ON, prefilling=len(self.committed))
        if p.follow:
            self.parked[i] = Following.park(i, p, i, 0.0, math.inf)
        else:
            self.committed[i] = p.now.upto  # the seed's clone (or nothing) lands at once

    def step(self) -> None:
        for i, done in list(self.committed.items()):
            end = len(self.prompts[i])
            stops = [f.target for f in self.parked.values() if f.leader == i]
            new = chunk_end(done, min(done + self.chunk, end), stops)
            if new > done:
                self.prefilled[i].append((done, new))
                self.committed[i] = new
        for i, f in list(self.parked.items()):
            if f.leader in self.committed and f.ready(self.committed[f.leader]):
                del self.parked[i]
                self.committed[i] = f.target

    def cancel(self, i: int) -> None:
        self.gone.add(i)
        promo = promote(i, self.committed.pop(i, 0), list(self.parked.values()))
        self.parked.pop(i, None)
        for rid in promo.replan:
            del self.parked[rid]
        if promo.heir is not None:
            del self.parked[promo.heir]
            self.committed[promo.heir] = promo.upto
        for rid in promo.replan:
            self.admit(rid)

    def finished(self) -> bool:
        return not self.parked and all(self.committed[i] == len(p) for i, p in enumerate(self.prompts)
                                       if i not in self.gone)


def run_burst(prompts, chunk: int, cancel: tuple[int, int] | None) -> Sim:
    sim = Sim(list(prompts), chunk)
    for i in range(len(prompts)):
        sim.admit(i)
    bound = sum(map(len, prompts)) + 2  # every step a prefilling request moves, so this many steps suffice
    for t in range(bound):
        if cancel and cancel[1] == t:
            sim.cancel(cancel[0])
        if sim.finished():
            return sim
        sim.step()
    raise AssertionError(f"stuck: {prompts} cancel={cancel} parked={sim.parked} committed={sim.committed}")


def assert_nothing_prefilled_twice(sim: Sim) -> None:
    for i, j in itertools.combinations(range(len(sim.prompts)), 2):
        a, b = sim.prompts[i], sim.prompts[j]
        shared = min(common_prefix(a, b), len(a) - 1, len(b) - 1)  # last tokens always run
        for (s1, e1), (s2, e2) in itertools.product(sim.prefilled[i], sim.prefilled[j]):
            assert max(s1, s2) >= min(e1, e2, shared), (sim.prompts, sim.prefilled)


def small_bursts():
    seqs = [p for n in range(1, 4) for p in itertools.product(range(2), repeat=n)]
    return itertools.product(seqs, repeat=3)


def test_every_small_burst_prefills_each_shared_token_once():
    for prompts in small_bursts():
        sim = run_burst(prompts, chunk=1, cancel=None)
        assert_nothing_prefilled_twice(sim)


def test_cancelling_a_leader_or_follower_at_every_step_loses_no_one():
    for prompts in small_bursts():
        for who, when in itertools.product(range(2), range(4)):
            sim = run_burst(prompts, chunk=1, cancel=(who, when))
            assert_nothing_prefilled_twice(sim)


def test_random_longer_bursts_with_chunks():
    rng = random.Random(7)
    for _ in range(300):
        base = [rng.randrange(3) for _ in range(12)]
        prompts = [tuple(base[:rng.randrange(1, 13)] + [rng.randrange(3) for _ in range(rng.randrange(4))])
                   for _ in range(5)]
        chunk = rng.choice((1, 3, 5))
        cancel = (rng.randrange(5), rng.randrange(8)) if rng.random() < 0.7 else None
        sim = run_burst(prompts, chunk, cancel)
        assert_nothing_prefilled_twice(sim)


def test_six_identical_prefix_requests_prefill_the_shared_part_once():
    shared = tuple(range(40))
    prompts = [shared + (100 + i, 200 + i) for i in range(6)]
    sim = run_burst(prompts, chunk=8, cancel=None)
    computed = sum(e - s for ranges in sim.prefilled for s, e in ranges)
    assert computed == 40 + 6 * 2
    assert sim.prefilled[0][0] == (0, 8) and all(r[0][0] == 40 for r in sim.prefilled[1:])


# ---- measured rates ----

def test_rate_tracker_starts_from_the_prior_and_follows_measurements():
    tracker = RateTracker(prior=Rates(prefill_tps=123.0, clone_fixed_s=0.5, clone_s_per_token=0.25))
    assert tracker.rates == tracker.prior
    tracker = tracker.observe_prefill(1000, 2.0)
    assert tracker.rates.prefill_tps == pytest.approx(500.0)  # the first sample replaces the prior
    for _ in range(60):
        tracker = tracker.observe_prefill(300, 3.0)
    assert tracker.rates.prefill_tps == pytest.approx(100.0, rel=1e-3)
    assert tracker.observe_prefill(0, 1.0) == tracker and tracker.observe_prefill(5, 0.0) == tracker


def test_rate_tracker_recovers_the_clone_line():
    tracker = RateTracker()
    for tokens in [100, 2000, 500, 1500, 50, 1000] * 5:
        tracker = tracker.observe_clone(tokens, 0.003 + 2e-6 * tokens)
    assert tracker.rates.clone_fixed_s == pytest.approx(0.003, rel=1e-6)
    assert tracker.rates.clone_s_per_token == pytest.approx(2e-6, rel=1e-6)


def test_rate_tracker_clones_of_one_size_keep_the_prior_fixed_part():
    tracker = RateTracker(prior=Rates(clone_fixed_s=0.001))
    for _ in range(3):
        tracker = tracker.observe_clone(1000, 0.011)
    assert (tracker.rates.clone_fixed_s, tracker.rates.clone_s_per_token) == pytest.approx((0.001, 1e-5))
    cheap = RateTracker(prior=Rates(clone_fixed_s=0.1)).observe_clone(1000, 0.01)
    assert (cheap.rates.clone_fixed_s, cheap.rates.clone_s_per_token) == pytest.approx((0.01, 0.0))


def test_rate_tracker_never_fits_a_negative_cost():
    tracker = RateTracker()
    for tokens, seconds in [(10, 0.0), (1000, 1.0), (10, 0.0), (1000, 1.0)]:
        tracker = tracker.observe_clone(tokens, seconds)
    rates = tracker.rates
    assert rates.clone_fixed_s >= 0 and rates.clone_s_per_token >= 0
    assert rates.clone_s(0) == 0.0 and rates.clone_s(1000) == pytest.approx(1.0, rel=0.05)
