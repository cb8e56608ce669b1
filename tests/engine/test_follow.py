"""Following the leader: the policy (the cost model's choices, leader election, deadlines) as pure
functions, then through the engine on the scripted backend (a burst prefills its shared prefix once)."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from dataclasses import replace

import pytest

from kvfork.server.engine.policy import follow as following
from kvfork.server.engine.policy.follow import FollowDecision, FollowPolicy, FollowOrder, Leader, at_deadline, leader_views
from kvfork.server.engine.policy.matching import Recipient, Source, choose_reuse, common_prefix
from kvfork.server.engine.policy.rates import Rates
from engine_harness import collect, prompt_of, reached, request, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend
from kvfork.server.engine.api import CapacityExhausted


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


# ---- through the engine, on the scripted backend ----

S, T = 200, 5
SHARED = prompt_of(S, start=3)
PROMPTS = [SHARED + [10 + i] * T for i in range(6)]
FOLLOW = dict(active_prefix_reuse_min_tokens=8, prefix_cache_entries=0, prefill_chunk=32)


def slow_prefill(backend: ScriptedBackend) -> ScriptedBackend:
    """Prefill at a model-like rate (a few thousand tokens/s): with the scripted backend's instant prefill,
    the measured rates make cloning what is committed now always cheaper than waiting."""
    backend.delay["prefill"] = 0.005
    return backend


async def burst(engine, prompts=PROMPTS, max_tokens=4):
    handles = [engine.submit(request(p, max_tokens, rid=f"r{i}")) for i, p in enumerate(prompts)]
    return handles, await asyncio.gather(*(collect(h) for h in handles))


@pytest.mark.parametrize("window", [None, 16])
async def test_a_burst_of_six_prefills_the_shared_prefix_once(window):
    backend = ScriptedBackend(window=window)
    engine = await start_engine(backend, **FOLLOW)
    _, results = await burst(engine)
    for p, (tokens, done) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4) and done.finish_reason == "length"
    assert [done.usage.prefilled_tokens for _, done in results] == [S + T] + [T] * 5
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results[1:]] == [("donor", S)] * 5
    assert engine.metrics.prefilled_tokens.get() == S + 6 * T
    assert engine.metrics.follow.get(choice="follow") == 5
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_clone_now_alone_saves_little_in_a_burst():
    backend = ScriptedBackend()
    engine = await start_engine(backend, **FOLLOW, follow=False)
    _, results = await burst(engine)
    for p, (tokens, _) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4)
    assert engine.metrics.prefilled_tokens.get() == 6 * (S + T)  # nobody had committed anything yet
    await engine.shutdown(1)


async def test_followers_wait_without_a_slot_and_then_take_one():
    backend = ScriptedBackend()
    engine = await start_engine(backend, **FOLLOW, inference_slots=1)
    _, results = await burst(engine, PROMPTS[:4])
    for p, (tokens, _) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4)
    assert engine.metrics.prefilled_tokens.get() == S + 4 * T
    await engine.shutdown(1)


@pytest.mark.parametrize("cancel_at", [0, 64, 160, 192, "decoding"])
async def test_leader_cancelled_at_every_phase(cancel_at):
    backend = ScriptedBackend(window=16)
    engine = await start_engine(backend, **FOLLOW)
    if cancel_at == "decoding":
        gate = backend.gates["decode"] = Gate()
    else:
        gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == cancel_at)
    handles = [engine.submit(request(p, 4, rid=f"r{i}")) for i, p in enumerate(PROMPTS)]
    await reached(gate)
    handles[0].cancel()
    gate.open()
    results = await asyncio.gather(*(collect(h) for h in handles))
    leader_tokens, leader_done = results[0]
    assert leader_done.finish_reason == "cancelled"
    for p, (tokens, done) in zip(PROMPTS[1:], results[1:]):
        assert done.finish_reason == "length" and tokens == backend.greedy(p, 4)
    # nothing of the shared part was prefilled twice: beyond it, each request computed at most its own tail
    leader_prefilled = leader_done.usage.prefilled_tokens
    total = sum(done.usage.prefilled_tokens for _, done in results)
    assert total == S + 5 * T + max(0, leader_prefilled - S)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    stats = engine.stats()
    assert stats.slots_used == 0 and stats.reserved == 0 and not stats.abandoned
    await engine.shutdown(1)


async def test_a_follower_past_its_wait_takes_the_seed_path():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW, follow_max_wait=0.2)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)  # the leader is stuck inside a chunk
    follower = engine.submit(request(PROMPTS[1], 4))
    assert engine.serving.following
    await asyncio.sleep(0.3)  # past its follow deadline: it stops following, nothing waits forever
    assert not engine.serving.following
    gate.open()
    tokens, done = await collect(follower)
    assert tokens == backend.greedy(PROMPTS[1], 4)
    assert done.usage.reuse_source == "donor" and done.usage.reused_tokens == 64  # what was committed then
    assert engine.metrics.follow.get(choice="follow") == 1  # it did follow first
    await collect(leader)
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_a_follower_whose_leader_slows_down_goes_on_following_while_that_is_cheaper():
    """Issue 23: on a loaded machine followers waited out --follow-max-wait, cloned half the prefix
    and prefilled the rest, answering after reuse off. At the deadline the costs are compared with
    the leader's measured progress: it is still moving, so the follower keeps following."""
    backend = ScriptedBackend()
    backend.delay["prefill"] = 0.002
    engine = await start_engine(backend, **FOLLOW, follow_max_wait=0.5)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)
    follower = engine.submit(request(PROMPTS[1], 4))
    assert engine.serving.following  # the measured rate puts the leader's target well within the wait
    backend.delay["prefill"] = 0.3  # the machine slows down: the rest (5 chunks) takes three times the wait
    gate.open()
    tokens, done = await collect(follower)
    assert tokens == backend.greedy(PROMPTS[1], 4)
    assert done.usage.reuse_source == "donor" and done.usage.reused_tokens == S  # all of the shared prefix
    await collect(leader)
    await settled(engine, backend)
    await engine.shutdown(1)


async def test_a_follower_cancelled_while_parked_leaves_nothing():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)
    follower = engine.submit(request(PROMPTS[1], 4))
    behind = engine.submit(request(PROMPTS[2], 4))
    follower.cancel()
    assert (await collect(follower))[1].finish_reason == "cancelled"
    gate.open()
    tokens, done = await collect(behind)
    assert tokens == backend.greedy(PROMPTS[2], 4) and done.usage.reused_tokens == S
    assert (await collect(leader))[0] == backend.greedy(PROMPTS[0], 4)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_shutdown_with_followers_parked():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    handles = [engine.submit(request(p, 4)) for p in PROMPTS]
    await reached(gate)
    closing = asyncio.create_task(engine.shutdown(grace_s=0.01))
    await until(lambda: all(r.ending == "cancelled" for r in engine.requests()))  # the grace has run out
    gate.open()
    await closing
    for h in handles:
        assert (await collect(h))[1].finish_reason == "cancelled"
    assert backend.live_sessions() == 0


async def test_races_repeated():
    """Bursts with random timing, cancellations and windows: every stream exact, nothing leaks. Time-boxed."""
    import random
    import time
    rng = random.Random(9)
    deadline = time.monotonic() + 20
    for repeat in range(25):
        if time.monotonic() > deadline:
            break
        backend = ScriptedBackend(window=rng.choice([None, 16]))
        backend.delay = {"prefill": rng.choice([0, 0.001]), "decode": rng.choice([0, 0.0005]),
                         "clone": rng.choice([0, 0.001])}
        engine = await start_engine(backend, **{**FOLLOW, "inference_slots": rng.choice([1, 3, 8]),
                                                "prefill_chunk": rng.choice([16, 32, 64])})
        shared = prompt_of(rng.randint(40, 160), start=repeat)
        prompts = [shared[:rng.randint(len(shared) // 2, len(shared))] + prompt_of(rng.randint(1, 6), start=50 + i)
                   for i in range(6)]
        handles = []
        for p in prompts:
            handles.append(engine.submit(request(p, rng.randint(1, 8))))
            if rng.random() < 0.5:
                await asyncio.sleep(rng.choice([0, 0.001, 0.003]))
            if rng.random() < 0.25:
                rng.choice(handles).cancel()
        for p, h in zip(prompts, handles):
            tokens, done = await collect(h)
            assert done.finish_reason in ("length", "cancelled"), (repeat, done)
            assert tokens == backend.greedy(p, len(tokens)), (repeat, done.usage)
        await settled(engine, backend)
        stats = engine.stats()
        assert stats.slots_used == 0 and stats.reserved == 0 and not stats.abandoned
        assert not engine.serving.following
        await engine.shutdown(1)
        assert backend.live_sessions() == 0


async def test_followers_count_against_the_queue_and_its_timeout():
    backend = slow_prefill(ScriptedBackend())
    engine = await start_engine(backend, **FOLLOW, inference_slots=1, max_queue=1, queue_timeout=0.2)
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 64)
    leader = engine.submit(request(PROMPTS[0], 4))
    await reached(gate)
    follower = engine.submit(request(PROMPTS[1], 4))
    assert engine.serving.following  # parked, holding no slot
    with pytest.raises(CapacityExhausted):
        engine.submit(request(PROMPTS[2], 4))  # the slot is taken and the follower fills the queue
    tokens, done = await collect(follower)  # the leader is stuck past the queue timeout
    assert done.finish_reason == "error" and "queue-timeout" in done.error and tokens == []
    gate.open()
    assert (await collect(leader))[0] == backend.greedy(PROMPTS[0], 4)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_cache_entries_on_a_sliding_model_never_block_following():
    """A cached prompt longer than the window serves only a clone at its end (matching.window_floor): an
    entry that shares the burst's 200 tokens must not report a match the backend will refuse."""
    backend = slow_prefill(ScriptedBackend(window=16))
    engine = await start_engine(backend, **{**FOLLOW, "prefix_cache_entries": 16})
    tokens, _ = await collect(engine.submit(request(PROMPTS[5], 4)))
    assert engine.serving.index.count("memory") == 1  # SHARED + 5 tokens, longer than the window
    _, results = await burst(engine, PROMPTS[:4])
    for p, (tokens, done) in zip(PROMPTS, results):
        assert tokens == backend.greedy(p, 4) and done.finish_reason == "length"
    assert [done.usage.reused_tokens for _, done in results] == [0, S, S, S]
    await engine.shutdown(1)
