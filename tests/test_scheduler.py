"""The step policy and admission arithmetic, as pure functions."""

from server.engine.scheduler import Running, clamp_max_tokens, fit_admission, plan_step


def test_every_decoding_request_decodes_before_any_prefill():
    running = [Running(1, 0), Running(2, 100), Running(3, 0), Running(4, 0)]
    plan = plan_step(running, max_batch_tokens=10, prefill_chunk=512)
    assert plan.decode == [1, 3, 4]
    assert plan.prefill == [(2, 7)]  # what the decodes left of the budget
    assert plan.tokens == 10


def test_decodes_run_even_when_they_fill_the_budget():
    running = [Running(i, 0) for i in range(5)] + [Running(9, 50)]
    plan = plan_step(running, max_batch_tokens=4, prefill_chunk=8)
    assert plan.decode == [0, 1, 2, 3, 4] and plan.prefill == []


def test_prefill_chunks_are_capped_by_chunk_size_and_what_is_left():
    plan = plan_step([Running(1, 1000), Running(2, 3), Running(3, 1000)], max_batch_tokens=2048, prefill_chunk=512)
    assert plan.prefill == [(1, 512), (2, 3), (3, 512)]


def test_prefill_rotates_so_no_prompt_starves():
    running = [Running(1, 1000), Running(2, 1000), Running(3, 1000)]
    first = plan_step(running, max_batch_tokens=600, prefill_chunk=512)
    assert first.prefill == [(1, 512), (2, 88)]
    second = plan_step(running, 600, 512, first.last_prefilled)
    assert second.prefill == [(3, 512), (1, 88)]
    third = plan_step(running, 600, 512, second.last_prefilled)
    assert third.prefill == [(2, 512), (3, 88)]


def test_rotation_survives_the_last_served_request_leaving():
    plan = plan_step([Running(1, 10), Running(5, 10)], max_batch_tokens=10, prefill_chunk=10, last_prefilled=3)
    assert plan.prefill == [(5, 10)]
    plan = plan_step([Running(1, 10), Running(5, 10)], max_batch_tokens=10, prefill_chunk=10, last_prefilled=7)
    assert plan.prefill == [(1, 10)]


def test_idle_step_is_empty():
    plan = plan_step([], 2048, 512, last_prefilled=4)
    assert plan.tokens == 0 and plan.last_prefilled == 4


def test_admission_fits_in_free_budget():
    assert fit_admission(need=10, held=80, cache_bytes=0, budget=100).admit


def test_prefix_cache_gives_way_only_as_far_as_needed():
    fit = fit_admission(need=30, held=90, cache_bytes=50, budget=100)
    assert fit.admit and fit.evict_bytes == 20


def test_admission_waits_when_even_the_cache_cannot_make_room():
    fit = fit_admission(need=30, held=95, cache_bytes=10, budget=100)
    assert not fit.admit and not fit.never


def test_a_request_larger_than_the_budget_never_fits():
    assert fit_admission(need=101, held=0, cache_bytes=0, budget=100).never


def test_max_tokens_default_and_clamp_to_context():
    assert clamp_max_tokens(None, 512, prompt_len=100, max_context=4096) == 512
    assert clamp_max_tokens(0, 512, 100, 4096) == 512
    assert clamp_max_tokens(50, 512, 100, 4096) == 50
    assert clamp_max_tokens(5000, 512, 100, 4096) == 3996


# ---- the time budget (--max-step-ms), on simulated rates ----

from server.engine.rates import RateTracker  # noqa: E402
from server.engine.scheduler import MIN_PREFILL_SHARE, TimeBudget  # noqa: E402


class SimulatedBackend:
    """Step seconds = per-row decode cost + prefill tokens at a fixed rate: what the runner would measure."""

    def __init__(self, decode_s_per_row: float, prefill_tps: float):
        self.decode_s_per_row, self.prefill_tps = decode_s_per_row, prefill_tps

    def step(self, plan) -> tuple[float, float]:
        return len(plan.decode) * self.decode_s_per_row, sum(n for _, n in plan.prefill) / self.prefill_tps


def run_steps(running: dict[int, int], sim: SimulatedBackend, max_step_s: float, steps: int,
              max_batch_tokens: int = 2048, prefill_chunk: int = 512, caps: dict[int, int] | None = None):
    """Drive plan_step the way the runner does; `running` maps rid -> prefill left (0: decoding)."""
    tracker, rotation, log = RateTracker(), None, []
    for _ in range(steps):
        rates = tracker.rates
        budget = TimeBudget(max_step_s, rates.decode_s, rates.prefill_tps)
        reqs = [Running(rid, left, (caps or {}).get(rid)) for rid, left in running.items()]
        plan = plan_step(reqs, max_batch_tokens, prefill_chunk, rotation, budget)
        rotation = plan.last_prefilled
        decode_s, prefill_s = sim.step(plan)
        if plan.decode:
            tracker = tracker.observe_decode(decode_s)
        tracker = tracker.observe_prefill(sum(n for _, n in plan.prefill), prefill_s)
        for rid, n in plan.prefill:
            running[rid] -= n
        log.append((plan, decode_s + prefill_s, reqs))
    return log


def test_steps_that_decode_stay_within_the_time_budget_once_rates_are_measured():
    sim = SimulatedBackend(decode_s_per_row=0.02, prefill_tps=400.0)
    running = {1: 0, 2: 0, 3: 0, 4: 4000}
    log = run_steps(running, sim, max_step_s=0.25, steps=30)
    for plan, seconds, _ in log[2:]:  # the first steps run on the prior's rates
        assert plan.prefill and seconds <= 0.25 * 1.01
    # the budget is used, not wasted: prefill fills what the decodes leave
    assert all(seconds >= 0.25 * 0.9 for _, seconds, _ in log[2:] if running[4] > 0)


def test_decode_rows_are_never_dropped_and_a_long_prefill_still_finishes():
    # the decode rows alone take longer than the budget: prefill still gets its share every step
    sim = SimulatedBackend(decode_s_per_row=0.1, prefill_tps=400.0)
    running = {1: 0, 2: 0, 3: 0, 4: 1000}
    log = run_steps(running, sim, max_step_s=0.2, steps=60)
    for plan, _, reqs in log:
        assert plan.decode == [r.rid for r in reqs if r.prefill_left == 0]
        if any(r.prefill_left for r in reqs):
            assert plan.prefill  # progress every step
    assert running[4] == 0
    floor = round(MIN_PREFILL_SHARE * 0.3 * 400) - 1  # a share of the decode rows' 0.3 s; the rate is a float
    assert all(n >= floor for plan, _, reqs in log[2:] for _, n in plan.prefill
               if any(r.rid == 4 and r.prefill_left >= floor for r in reqs))


def test_token_caps_and_clone_points_bind_before_the_time_budget():
    generous = TimeBudget(max_step_s=10.0, decode_s=0.0, prefill_tps=1000.0)  # 10,000 tokens' worth
    running = [Running(1, 0), Running(2, 5000), Running(3, 5000, prefill_cap=40)]
    plan = plan_step(running, max_batch_tokens=700, prefill_chunk=512, time_budget=generous)
    assert plan.prefill == [(2, 512), (3, 40)]  # --prefill-chunk, then the follower's clone point
    tight = TimeBudget(max_step_s=0.1, decode_s=0.05, prefill_tps=1000.0)  # 50 tokens' worth
    plan = plan_step(running, max_batch_tokens=700, prefill_chunk=512, time_budget=tight)
    assert plan.prefill == [(2, 50)]
    plan = plan_step(running, 700, 512, plan.last_prefilled, tight)
    assert plan.prefill == [(3, 40), (2, 10)]  # the clone point ends its chunk; the rest goes on


def test_a_step_without_decodes_ignores_the_time_budget():
    tight = TimeBudget(max_step_s=0.01, decode_s=0.0, prefill_tps=100.0)
    plan = plan_step([Running(1, 3000)], max_batch_tokens=2048, prefill_chunk=512, time_budget=tight)
    assert plan.prefill == [(1, 512)]
