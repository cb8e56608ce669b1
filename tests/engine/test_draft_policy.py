"""Speculative decoding's batch-level policy (server/engine/policy/draft_policy.py): which rows draft in a
step, from their acceptance and what a drafted token costs at the step's batch size. No backend."""

from __future__ import annotations

import itertools
import random

import pytest

from kvfork.server.engine.policy import draft_policy as dp
from kvfork.server.engine.policy.draft_policy import Acceptance, DraftPolicy, StepCost, break_even, draft_pays

BATCHES = range(1, 9)
RATIOS = [None, 0.0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, float("inf")]
SHARES = [i / 20 + 0.005 for i in range(20)]  # off the break evens, which float rounding decides


def test_draft_pays_exactly_where_the_step_gains_throughput():
    """Exhaustive over batch sizes, costs and acceptance: a row drafting d tokens at acceptance p
    draft_pays iff b tokens in T0 seconds become more tokens per second, b + p d in T0 + c d (and p clears
    the floor); a row that skipped PROBE_EVERY steps always drafts."""
    t0, d = 1.0, 4
    for b, ratio, p in itertools.product(BATCHES, RATIOS, SHARES):
        if ratio is None or ratio == float("inf"):
            want = p > (dp.FLOOR if ratio is None else float("inf"))
        else:
            c = ratio * t0
            want = (b + p * d) / (t0 + c * d) > b / t0 and p > dp.FLOOR
        assert draft_pays(p, b, ratio, 0) == want, (b, ratio, p)
        assert draft_pays(p, b, ratio, dp.PROBE_EVERY)
        assert draft_pays(p, b, ratio, dp.PROBE_EVERY - 1) == want


def test_break_even_grows_with_the_batch_and_the_cost():
    for ratio in RATIOS[1:]:
        line = [break_even(b, ratio) for b in BATCHES]
        assert line == sorted(line) and all(x >= dp.FLOOR for x in line)
    for b in BATCHES:
        assert break_even(b, None) == dp.FLOOR
        line = [break_even(b, r) for r in RATIOS[1:]]
        assert line == sorted(line)
    assert break_even(4, 0.15) == pytest.approx(0.6)


def test_step_cost_recovers_a_drafted_tokens_share_of_the_step():
    cost = StepCost()
    rng = random.Random(1)
    for i in range(200):
        x = rng.randrange(0, 17)
        cost = cost.observe(x, 0.08 + 0.004 * x)
        assert (cost.ratio() is None) == (i + 1 < dp.MIN_STEPS)
    assert cost.ratio() == pytest.approx(0.004 / 0.08, rel=1e-6)


def test_step_cost_is_unknown_without_drafted_spread_and_bounded_at_its_edges():
    same = StepCost()
    for _ in range(50):
        same = same.observe(3, 0.05)
    assert same.ratio() is None  # one drafted count cannot separate a step's parts
    flat, steep = StepCost(), StepCost()
    for x in [0, 4, 8] * 10:
        flat = flat.observe(x, 0.05 - 0.001 * x)  # more drafts, faster: noise, never a negative cost
        steep = steep.observe(x, 0.01 * x)  # nothing but drafts: no step without them to compare
    assert flat.ratio() == 0.0
    assert steep.ratio() == float("inf")


def test_acceptance_decays_old_drafts_and_shrinks_towards_the_prior():
    a = Acceptance()
    assert a.share(0.7, 8) == 0.7 and a.share() == 1.0  # no drafts: the prior
    a = a.after(4, 0)
    assert a.share() == 0.0 and a.share(0.5, 4) == pytest.approx(0.25)
    a = a.after(4, 4)
    assert a.share() == pytest.approx(4 / (4 + 4 * dp.RECENT))  # the older, rejected draft counts less
    for _ in range(60):
        a = a.after(2, 2)
    assert a.share(0.0, dp.PRIOR_TOKENS) > 0.5  # a long record outweighs the prior


def simulate(policy: DraftPolicy, shares: list[float], steps: int, t0: float, c: float, length: int = 4) -> list[int]:
    """Steps of one batch, row i's drafts accepted at shares[i] (as a fraction, spread evenly); each
    step's seconds from the cost line. Returns how many steps each row drafted in."""
    batch, drafted = len(shares), [0] * len(shares)
    own = [Acceptance() for _ in shares]
    skipped = [0] * len(shares)
    carry = [0.0] * len(shares)
    for _ in range(steps):
        tokens = 0
        for i, share in enumerate(shares):
            if policy.baseline(batch):
                continue
            if not policy.allows(own[i], batch, skipped[i]):
                skipped[i] += 1
                continue
            skipped[i], drafted[i] = 0, drafted[i] + 1
            carry[i] += share * length
            accepted = min(length, int(carry[i]))
            carry[i] -= accepted
            own[i] = own[i].after(length, accepted)
            policy.verified(length, accepted)
            tokens += length
        policy.step(batch, tokens, t0 + c * tokens)
    return drafted


def test_rejected_drafts_stop_at_four_rows_but_not_at_one():
    """Prose: drafts accepted at 30%. A drafted token costs 15% of a step: at four rows the break
    even is 60% and the rows draft only to probe; alone, the break even is 15% and it drafts on.
    All steps draft alike here, so the policy's own steps without drafts give the cost line its other end."""
    steps = 400
    four = simulate(DraftPolicy(), [0.3] * 4, steps, t0=0.1, c=0.015)
    assert all(n <= steps // dp.PROBE_EVERY + 4 * dp.MIN_STEPS for n in four)
    one = simulate(DraftPolicy(), [0.3], steps, t0=0.1, c=0.015)
    assert one[0] >= steps - dp.MIN_STEPS  # all but a few steps without drafts that fix the cost


def test_a_row_whose_drafts_pay_drafts_beside_rows_whose_do_not():
    """A code edit (90% accepted) among three prose rows (20%) at four rows, break even 60%."""
    steps = 400
    code, *prose = simulate(DraftPolicy(), [0.9, 0.2, 0.2, 0.2], steps, t0=0.1, c=0.015)
    assert code >= steps - dp.MIN_STEPS
    assert all(n <= steps // dp.PROBE_EVERY + 4 * dp.MIN_STEPS for n in prose)


def test_probes_turn_drafting_back_on_when_the_text_repeats():
    """After prose that stopped drafting, the same rows' text turns repetitive (95% accepted): the
    probes see it, and drafting resumes within a few probes."""
    policy = DraftPolicy()
    simulate(policy, [0.2] * 4, 200, t0=0.1, c=0.015)
    steps = 20 * dp.PROBE_EVERY
    drafted = simulate(policy, [0.95] * 4, steps, t0=0.1, c=0.015)
    assert all(n >= steps - 4 * dp.PROBE_EVERY for n in drafted)


def test_costs_are_kept_per_batch_size():
    policy = DraftPolicy()
    for _ in range(dp.MIN_STEPS):
        for x in (0, 8):
            policy.step(1, x, 0.1 + 0.001 * x)
            policy.step(4, x, 0.1 + 0.02 * x)
    assert policy.costs[1].ratio() == pytest.approx(0.01) and policy.costs[4].ratio() == pytest.approx(0.2)
    rows = Acceptance().after(10, 5)  # 50% accepted
    assert policy.allows(rows, 1, 0) and not policy.allows(rows, 4, 0)
    assert policy.allows(rows, 2, 0)  # no steps of two rows seen: only the floor applies


def test_computed_positions_follow_the_pass_layout():
    """A ragged pass computes each row's drafted tokens; a padded one every row at the longest draft."""
    for drafted in itertools.product(range(4), repeat=3):
        assert dp.computed(drafted, padded=False) == sum(drafted)
        assert dp.computed(drafted, padded=True) == 3 * max(drafted)
    assert dp.computed([], padded=True) == dp.computed([], padded=False) == 0


def padded_rate(expected, drafted, length, batch, ratio):
    """Tokens per T0 of a padded step whose drafts are trimmed to `length`."""
    if length == 0:
        return float(batch)
    return (batch + sum(p * min(d, length) for p, d in zip(expected, drafted))) / (1 + ratio * batch * length)


def test_common_length_gives_the_most_tokens_per_second_and_never_fewer_than_off():
    """Exhaustive over two or three drafted rows (acceptance, length) in batches up to 4 and the costs: the
    length chosen is the best of every length, drafts trimmed to it, a tie to the shorter; without a probe
    it never gives fewer tokens per second than not drafting, and it drafts whenever drafting gains."""
    shares, lengths = [0.155, 0.455, 0.955], [1, 3, 8]  # off the break evens, which float rounding decides
    for rows, batch, ratio in itertools.product([2, 3], range(3, 5), RATIOS[:-1]):
        r = ratio or 0.0
        for expected in itertools.product(shares, repeat=rows):
            for drafted in itertools.product(lengths, repeat=rows):
                got = dp.common_length(expected, drafted, [False] * rows, batch, ratio)
                rates = [padded_rate(expected, drafted, n, batch, r) for n in range(max(drafted) + 1)]
                best = max(rates)
                assert got == rates.index(best), (expected, drafted, batch, ratio)
                assert rates[got] >= batch and (got > 0) == (best > batch)


def test_a_probe_drafts_a_few_tokens_where_nothing_else_pays():
    """A probing row drafts at least min(its length, PROBE_TOKENS) tokens, more where that pays; an
    unbounded cost drafts only the probe."""
    probe = dp.PROBE_TOKENS
    assert dp.common_length([0.0], [16], [True], 4, 1.0) == probe
    assert dp.common_length([0.0], [2], [True], 4, 1.0) == 2
    assert dp.common_length([0.0, 0.0], [16, 16], [False, False], 4, 1.0) == 0
    assert dp.common_length([0.0, 0.99], [16, 16], [True, False], 4, 0.001) == 16
    assert dp.common_length([0.99, 0.99], [16, 16], [True, False], 4, float("inf")) == probe
    assert dp.common_length([0.99, 0.99], [16, 16], [False, False], 4, float("inf")) == 0
    assert dp.common_length([0.2, 0.3], [5, 9], [False, False], 4, None) == 9  # an unknown cost: all of every draft


def test_a_ragged_pass_decides_each_row_by_its_own_break_even():
    """Torch's decisions (ragged passes) are the per-row rule whatever `padded` adds: `allows` without it is
    draft_pays at the batch's learnt ratio; with it (a padded pass) only the floor and probes decide, and
    common_length decides the rest."""
    policy = DraftPolicy()
    for _ in range(dp.MIN_STEPS):
        for x in (0, 8):
            policy.step(4, x, 0.1 + 0.005 * x)
    ratio = policy.costs[4].ratio()
    assert ratio == pytest.approx(0.05)
    for drafted, accepted, skipped in itertools.product(range(1, 12, 2), range(0, 12, 2), range(dp.PROBE_EVERY + 1)):
        own = Acceptance().after(drafted, min(drafted, accepted))
        expected = policy.expected(own)
        assert policy.allows(own, 4, skipped) == draft_pays(expected, 4, ratio, skipped)
        assert policy.allows(own, 4, skipped, padded=True) == draft_pays(expected, 4, None, skipped)
