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
