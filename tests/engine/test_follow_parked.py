"""Parked followers: deadlines, chunk stops, promotion, and a step simulator.

The burst tests run the simulator over every small burst: each prefilling
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

from kvfork.server.engine.policy.follow import FollowPolicy, FollowOrder, Leader, Promotion, chunk_end, leader_views, promote
from kvfork.server.engine.policy.matching import Recipient, Source
from kvfork.server.engine.policy.rates import Rates
from test_follow import FREE_CLONES, ON, active, decide


def test_a_parked_follower_waits_for_its_target_until_its_first_deadline():
    shared = list(range(100))
    p = decide(Recipient("b", shared + [2]), [active("a", shared + [1], 0)], 0, FREE_CLONES, ON, 1)
    f = FollowOrder.park("b", p, order=3, first_parked_at=10.0, max_wait_s=5.0)
    assert (f.leader, f.target, f.deadline) == ("a", 100, 15.0)


def test_chunk_end_stops_at_follower_targets():
    assert chunk_end(0, 512, []) == 512
    assert chunk_end(0, 512, [300, 100, 700]) == 100
    assert chunk_end(100, 512, [100, 512]) == 512  # reached, or the chunk ends there anyway
    assert chunk_end(100, 512, [101]) == 101


def follower(rid, target, order, leader="gone") -> FollowOrder:
    return FollowOrder(rid, leader, target, order, math.inf)


def test_promotion_heir_salvages_most_then_earliest():
    parked = [follower("f3", 900, 3), follower("f1", 100, 1), follower("f2", 900, 2), follower("other", 5, 0, "x")]
    assert promote("gone", 600, parked) == Promotion("f2", 600)
    assert promote("gone", 50, parked) == Promotion("f1", 50)  # all salvage 50: the earliest takes over


def test_the_heir_is_a_direct_follower():
    parked = [follower("f1", 100, 1), follower("f2", 50, 2),
              follower("c1", 120, 5, leader="f1"), follower("x", 900, 0, leader="elsewhere")]
    assert promote("gone", 100, parked) == Promotion("f1", 100)


def test_heir_clones_the_gone_state_unless_another_leader_offers_more():
    shared = list(range(100))
    gone = Leader.active(Source.donor("gone", shared + [1], 60, 1), tps=0.0)  # a state that will not move
    heir = Recipient("heir", shared + [2])
    p = decide(heir, [gone], 0, FREE_CLONES, ON, prefilling=0)
    assert (p.follow, p.now.kind, p.now.donor, p.now.upto) == (False, "donor", "gone", 60)
    # another leader, further along the same prefix, commits all 100 soon: follow it instead
    other = active("other", shared + [3], 90, admitted=0)
    p = decide(heir, [gone, other], 0, FREE_CLONES, ON, prefilling=1)
    assert (p.follow, p.leader, p.target) == (True, "other", 100)


def test_promotion_with_nothing_to_salvage_has_no_heir():
    parked = [follower("f2", 10, 2), follower("f1", 10, 1), follower("c", 10, 3, leader="f2")]
    assert promote("gone", 0, parked) == promote("gone", 500, parked, state_usable=False) == Promotion(None, 0)
    assert promote("gone", 500, []) == Promotion(None, 0)


def below(gone, parked: dict[int, FollowOrder]) -> list[int]:
    """Everyone waiting on `gone`, directly or down a chain, earliest first: they plan again (reuse.gone)."""
    found, todo = [], [gone]
    while todo:
        leader = todo.pop()
        children = [i for i, f in parked.items() if f.leader == leader]
        found += children
        todo += children
    return sorted(found, key=lambda i: parked[i].order)


# ---- burst simulator ----

@dataclass
class Sim:
    prompts: list[tuple[int, ...]]
    chunk: int
    heir_plans: bool  # the heir plans, offered the gone state; else it clones it at once (as a runner can)
    policy: FollowPolicy = ON
    committed: dict[int, int] = field(default_factory=dict)  # prefilling or done, by request index
    parked: dict[int, FollowOrder] = field(default_factory=dict)
    prefilled: list[list[tuple[int, int]]] = field(default_factory=list)  # ranges each request computed
    gone: set[int] = field(default_factory=set)

    def __post_init__(self):
        self.prefilled = [[] for _ in self.prompts]

    def admit(self, i: int, gone: Leader | None = None) -> None:
        # time unit = one step; the recipient would prefill `chunk` tokens a step like everyone
        tps = float(self.chunk)
        active = [Leader.active(Source.donor(j, self.prompts[j], c, j), tps) for j, c in self.committed.items()]
        parked = [(f, Source.donor(j, self.prompts[j], 0, j)) for j, f in self.parked.items()]
        leaders = leader_views(active + ([gone] if gone else []), parked, FREE_CLONES, tps)
        p = decide(Recipient(i, self.prompts[i]), leaders, 0, Rates(self.chunk * (len(self.committed) + 1), 0, 0),
                 self.policy, prefilling=len(self.committed))
        if p.follow:
            self.parked[i] = FollowOrder.park(i, p, i, 0.0, math.inf)
        else:
            self.committed[i] = p.now.upto  # clone-now's clone (or nothing) lands at once

    def step(self) -> None:
        for i, done in list(self.committed.items()):
            end = len(self.prompts[i])
            stops = [f.target for f in self.parked.values() if f.leader == i]
            new = chunk_end(done, min(done + self.chunk, end), stops)
            if new > done:
                self.prefilled[i].append((done, new))
                self.committed[i] = new
        for i, f in list(self.parked.items()):
            if self.committed.get(f.leader, -1) >= f.target:  # what clone_orders.due serves
                del self.parked[i]
                self.committed[i] = f.target

    def cancel(self, i: int) -> None:
        self.gone.add(i)
        committed = self.committed.pop(i, 0)
        promo = promote(i, committed, list(self.parked.values()))
        replan = [rid for rid in below(i, self.parked) if rid != promo.heir]
        self.parked.pop(i, None)
        for rid in ([promo.heir] if promo.heir is not None else []) + replan:
            del self.parked[rid]
        if promo.heir is not None and self.heir_plans:
            self.admit(promo.heir, gone=Leader.active(Source.donor(i, self.prompts[i], committed, i), 0.0))
        elif promo.heir is not None:
            self.committed[promo.heir] = promo.upto
        for rid in replan:
            self.admit(rid)

    def finished(self) -> bool:
        return not self.parked and all(self.committed[i] == len(p) for i, p in enumerate(self.prompts)
                                       if i not in self.gone)


def run_burst(prompts, chunk: int, cancel: tuple[int, int] | None, heir_plans: bool = True,
              policy: FollowPolicy = ON) -> Sim:
    sim = Sim(list(prompts), chunk, heir_plans, policy)
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
    """Each token, known by the prefix it ends (equal prefixes, equal KV), is computed once.

    Exempt: a prompt's last token, which always runs to give its request fresh
    logits. When the heir clones at once instead of planning, it may inherit that
    duty from the gone leader whose last token it was.
    """
    computed_by: dict[tuple[int, ...], list[int]] = {}
    for i, ranges in enumerate(sim.prefilled):
        for start, end in ranges:
            for pos in range(start, end):
                computed_by.setdefault(sim.prompts[i][:pos + 1], []).append(i)
    inherited = set() if sim.heir_plans else {sim.prompts[g] for g in sim.gone}
    for key, who in computed_by.items():
        not_last = [i for i in who if sim.prompts[i] != key]
        assert len(not_last) <= 1 or key in inherited, (key, who, sim.prompts, sim.prefilled)


def small_bursts():
    seqs = [p for n in range(1, 4) for p in itertools.product(range(2), repeat=n)]
    return itertools.product(seqs, repeat=3)


def test_every_small_burst_prefills_each_shared_token_once():
    for prompts in small_bursts():
        sim = run_burst(prompts, chunk=1, cancel=None)
        assert_nothing_prefilled_twice(sim)


@pytest.mark.parametrize("heir_plans", [True, False])
def test_cancelling_a_leader_or_follower_at_every_step_loses_no_one(heir_plans):
    for prompts in small_bursts():
        for who, when in itertools.product(range(2), range(4)):
            sim = run_burst(prompts, chunk=1, cancel=(who, when), heir_plans=heir_plans)
            assert_nothing_prefilled_twice(sim)


@pytest.mark.parametrize("heir_plans", [True, False])
def test_random_longer_bursts_with_chunks(heir_plans):
    rng = random.Random(7)
    for _ in range(1500):
        base = [rng.randrange(3) for _ in range(12)]
        prompts = [tuple(base[:rng.randrange(1, 13)] + [rng.randrange(3) for _ in range(rng.randrange(4))])
                   for _ in range(5)]
        chunk = rng.choice((1, 3, 5))
        cancel = (rng.randrange(5), rng.randrange(8)) if rng.random() < 0.7 else None
        sim = run_burst(prompts, chunk, cancel, heir_plans)
        assert_nothing_prefilled_twice(sim)


def test_without_following_a_burst_prefills_the_shared_part_again():
    # clone-now alone: nothing is committed yet when the burst arrives
    prompts = [tuple(range(10)) + (100 + i,) for i in range(3)]
    sim = run_burst(prompts, chunk=4, cancel=None, policy=FollowPolicy(min_tokens=1, follow=False))
    assert sum(e - s for ranges in sim.prefilled for s, e in ranges) == 3 * 11
    with pytest.raises(AssertionError):
        assert_nothing_prefilled_twice(sim)


def test_six_identical_prefix_requests_prefill_the_shared_part_once():
    shared = tuple(range(40))
    prompts = [shared + (100 + i, 200 + i) for i in range(6)]
    sim = run_burst(prompts, chunk=8, cancel=None)
    computed = sum(e - s for ranges in sim.prefilled for s, e in ranges)
    assert computed == 40 + 6 * 2
    assert sim.prefilled[0][0] == (0, 8) and all(r[0][0] == 40 for r in sim.prefilled[1:])
