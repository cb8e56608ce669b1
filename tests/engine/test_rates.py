"""The rate tracker the follow cost model runs on."""

from __future__ import annotations

import pytest

from kvfork.server.engine.policy.rates import Rates, RateTracker

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


def test_rate_tracker_step_fit_starts_from_the_prior_and_separates_the_fixed_part():
    tracker = RateTracker(prior=Rates(decode_s=0.3, step_s_per_token=0.01))
    assert (tracker.rates.decode_s, tracker.rates.step_s_per_token) == (0.3, 0.01)
    tracker = tracker.observe_step(0, 0.1)  # decode alone: the fixed part, the prefill rate's per token
    assert tracker.rates.decode_s == pytest.approx(0.1) and tracker.rates.step_s_per_token == pytest.approx(1 / 500)
    for tokens in [0, 16, 200, 40, 0, 120] * 6:  # a fixed 80 ms and 2 ms a token: small chunks read no lower
        tracker = tracker.observe_step(tokens, 0.08 + 0.002 * tokens)
    assert tracker.rates.decode_s == pytest.approx(0.08, rel=1e-3)  # the first sample has all but decayed
    assert tracker.rates.step_s_per_token == pytest.approx(0.002, rel=1e-3)
    assert tracker.observe_step(5, 0.0) == tracker


def test_rate_tracker_steps_of_one_size_put_the_prefill_rate_per_token():
    tracker = RateTracker().observe_prefill(1000, 2.0)  # 500 tok/s alone
    for _ in range(5):
        tracker = tracker.observe_step(100, 0.5)
    assert tracker.rates.step_s_per_token == pytest.approx(0.002)
    assert tracker.rates.decode_s == pytest.approx(0.3)


def test_rate_tracker_keeps_verified_positions_off_the_decode_line():
    """Steps that verify drafted positions (speculation) fit their own per-position cost: the fixed part
    of a step that decodes, which the step budget sizes prefill chunks by, stays what plain steps take."""
    plain = RateTracker()
    for tokens in [0, 16, 200, 40, 0, 120] * 6:  # 80 ms fixed, 2 ms a prefill token
        plain = plain.observe_step(tokens, 0.08 + 0.002 * tokens)
    tracker = plain
    for drafted in [4, 16, 8, 12, 2] * 6:  # 0.5 ms a drafted position: near free while bound by the weights
        tracker = tracker.observe_step(0, 0.08 + 0.0005 * drafted, drafted)
    assert tracker.rates.decode_s == plain.rates.decode_s
    assert tracker.rates.step_s_per_token == plain.rates.step_s_per_token
    assert tracker.rates.verify_s_per_token == pytest.approx(0.0005, rel=1e-3)
    alike = plain
    for _ in range(5):  # drafts all of one length: what they took beyond the fixed part, per position
        alike = alike.observe_step(0, 0.08 + 0.0005 * 8, 8)
    assert alike.rates.verify_s_per_token == pytest.approx(0.0005, rel=1e-3)
    assert RateTracker().rates.verify_s_per_token == Rates().verify_s_per_token
    drafting = RateTracker()
    for drafted in [4, 16, 8, 12, 2]:  # no plain step yet: the fixed part is the drafted steps' line's
        drafting = drafting.observe_step(0, 0.08 + 0.0005 * drafted, drafted)
    assert drafting.rates.decode_s == pytest.approx(0.08, rel=1e-3)
