"""Speculative decoding in the engine, on both real backends and every test architecture: drafted
tokens are verified inside the batched step, the accepted run kept and the rest rolled back, so
greedy and seeded tokens are those of speculation off; a sampled request's tokens follow the same
distribution; clones, cancels, grammars-free requests and broken drafters leave nothing stale."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest

from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from engine_harness import TEST_CONFIG, collect, drafted_plans, request, run, settled
from kvfork.backends import create_backend
from kvfork.backends.base import SamplingParams
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.watch.metrics import Registry
from scripted_drafts import RequestDrafts, ScriptedDrafts
from tiny_hybrid_models import HYBRID_ARCHS

ARCHS = ["llama", "qwen3", "gemma3"]


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


async def engine_of(name: str, folder: str, drafts=None, **config) -> Engine:
    settings = dict(TEST_CONFIG, prefill_chunk=16)  # speculative decoding only where `drafts` are given
    engine = Engine(create_backend(name), folder, "float32", EngineConfig(**{**settings, **config}), Registry(),
                    drafts=drafts)
    await engine.start()
    return engine


def counted(engine: Engine) -> tuple[float, float]:
    m = engine.metrics
    return sum(m.spec_drafted.values.values()), sum(m.spec_accepted.values.values())


@pytest.mark.parametrize("arch", ARCHS)
async def test_greedy_tokens_are_those_of_speculation_off(backend_name, arch, tiny_model_dir):
    prompts = [prompt(24 + 5 * i, seed=i) for i in range(3)]
    off = await engine_of(backend_name, tiny_model_dir(arch), prefix_cache_entries=0)
    want = [(await run(off, p, 40, ignore_eos=True))[0] for p in prompts]
    await off.shutdown(1)
    drafts = ScriptedDrafts()
    on = await engine_of(backend_name, tiny_model_dir(arch), drafts, prefix_cache_entries=0)
    if not on.backend.rolls_back:
        pytest.skip(f"{backend_name} does not speculate on {arch} (its rings cannot roll back there)")
    first = [(await run(on, p, 40, ignore_eos=True))[0] for p in prompts]  # drafts from its own text
    again = await asyncio.gather(*(run(on, p, 40, ignore_eos=True) for p in prompts))  # from the outputs seen, batched
    assert first == want
    assert [tokens for tokens, _ in again] == want
    drafted, accepted = counted(on)
    assert drafted > accepted > 0  # it drafted, kept some and rolled some back
    await settled(on, on.backend)
    await on.shutdown(1)
    assert on.backend.live_sessions() == 0


async def test_only_the_rows_a_walk_reaches_are_sampled(backend_name, tiny_model_dir):
    """Every sampled logits row becomes one token (a drafted row's positions past its first rejected
    draft are never sampled), and the sampler is handed only the rows it samples: rows sampled equal
    tokens generated, though some drafts were rejected (their verify passes read rows past them)."""
    on = await engine_of(backend_name, tiny_model_dir("llama"), ScriptedDrafts(), prefix_cache_entries=0)
    if not on.backend.rolls_back:
        pytest.skip(f"{backend_name} does not speculate on llama")
    sampled, handed = [], []
    backend_sample = on.backend.sample

    def counting_sample(logits, states):
        sampled.append(len(states))
        handed.append(on.backend.to_numpy(logits).shape[0])
        return backend_sample(logits, states)

    on.backend.sample = counting_sample
    prompts = [prompt(20 + 3 * i, seed=50 + i) for i in range(3)]
    for q in prompts:  # its own text drafted, then the earlier outputs
        await run(on, q, 24, ignore_eos=True)
    await asyncio.gather(*(run(on, q, 24, ignore_eos=True) for q in prompts))
    drafted, accepted = counted(on)
    await on.shutdown(1)
    assert drafted > accepted > 0  # some drafts were rejected: rows past them were read, not sampled
    assert sampled == handed
    assert sum(sampled) == 2 * 3 * 24


async def test_the_request_log_line_says_what_speculation_saved(backend_name, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, "kvfork.requests")
    p = prompt(20, seed=14)
    on = await engine_of(backend_name, tiny_model_dir("llama"), ScriptedDrafts(spoil_every=0), prefix_cache_entries=0)
    await run(on, p, 16, ignore_eos=True)
    await run(on, p, 16, ignore_eos=True)  # drafts the first one's output: all accepted
    await on.shutdown(1)
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfork.requests"]
    saved = [json.loads(line.split(" ", 1)[1]).get("speculation_saved_tokens") for line in lines]
    assert saved[-1] == counted(on)[1] - (saved[0] or 0) and saved[-1] >= 8


async def test_a_hybrid_does_not_speculate_and_says_so_once(backend_name, tiny_hybrid_dir, caplog):
    caplog.set_level(logging.WARNING, "kvfork.engine")
    folder = tiny_hybrid_dir(HYBRID_ARCHS[0])
    p = prompt(20, seed=1)
    off = await engine_of(backend_name, folder)
    want, _ = await run(off, p, 12, ignore_eos=True)
    await off.shutdown(1)
    on = await engine_of(backend_name, folder, ScriptedDrafts())
    assert (await run(on, p, 12, ignore_eos=True))[0] == want
    assert (await run(on, p, 12, ignore_eos=True))[0] == want
    assert counted(on) == (0, 0)
    assert len([r for r in caplog.records if "speculative decoding off" in r.message]) == 1
    await on.shutdown(1)


async def test_seeded_sampling_gives_the_same_tokens_with_speculation(backend_name, tiny_model_dir):
    folder, p = tiny_model_dir("llama"), prompt(20, seed=3)
    params = [SamplingParams(temperature=0.9, seed=s, repetition_penalty=1.1) for s in range(4)]
    off = await engine_of(backend_name, folder, prefix_cache_entries=0)
    want = [(await collect(off.submit(request(p, 24, sampling=sp, ignore_eos=True))))[0] for sp in params]
    await off.shutdown(1)
    drafts = ScriptedDrafts(spoil_every=0)
    on = await engine_of(backend_name, folder, drafts, prefix_cache_entries=0)
    for sp in params:  # each run drafts from the outputs of the runs before it
        got, _ = await collect(on.submit(request(p, 24, sampling=sp, ignore_eos=True)))
        assert got == want[params.index(sp)]
    assert counted(on)[0] > 0
    await on.shutdown(1)


def pooled(counts: dict, rare: set) -> dict:
    out: dict = {}
    for cell, n in counts.items():
        key = (-1,) if cell in rare else cell  # one cell for all the rare ones
        out[key] = out.get(key, 0) + n
    return out


def chi_square(a: dict, b: dict) -> tuple[float, int]:
    """Two-sample chi-square statistic over the cells both samples use (those seen under 10 times
    in all pooled into one), and its degrees of freedom."""
    rare = {c for c in set(a) | set(b) if a.get(c, 0) + b.get(c, 0) < 10}
    a, b = pooled(a, rare), pooled(b, rare)
    cells = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for c in cells:
        x, y = a.get(c, 0), b.get(c, 0)
        stat += (x * np.sqrt(nb / na) - y * np.sqrt(na / nb)) ** 2 / (x + y)
    return stat, len(cells) - 1


async def test_sampled_tokens_follow_the_distribution_of_speculation_off(backend_name, tiny_model_dir):
    """The rejection rule: over many seeds, the (second, third) token pairs drawn with speculation on
    have the distribution of those drawn with it off (different seeds: two independent samples)."""
    folder, p, runs = tiny_model_dir("llama"), prompt(12, seed=5), 200
    sampling = dict(temperature=10.0, top_k=4)  # the tiny model's logits are steep: flattened to a spread
    samples = []
    for drafts, seeds in ((None, range(runs)), (ScriptedDrafts(spoil_every=0), range(10_000, 10_000 + runs))):
        engine = await engine_of(backend_name, folder, drafts, prefix_cache_entries=0)
        counts: dict[tuple[int, ...], int] = {}
        for seed in seeds:
            tokens, _ = await collect(engine.submit(request(p, 3, sampling=SamplingParams(**sampling, seed=seed),
                                                            ignore_eos=True)))
            counts[tuple(tokens[1:])] = counts.get(tuple(tokens[1:]), 0) + 1
        samples.append(counts)
        if drafts is not None:
            drafted, accepted = counted(engine)
            assert drafted > accepted > 0  # the rule accepted some drafts and rejected others
        await engine.shutdown(1)
    stat, df = chi_square(*samples)
    # the 0.999 quantile of chi-square is below 3.5 df + 12 for every df up to 100: a bound that fails
    # on a skewed rule (accepting every draft doubles the drafted pairs' counts) and never by chance here
    assert df >= 3 and stat < 3.5 * df + 12, (stat, df, samples)


async def test_a_clone_taken_from_a_speculating_request_holds_only_what_it_committed(backend_name, tiny_model_dir):
    folder = tiny_model_dir("qwen3")
    shared, tail = prompt(40, seed=7), prompt(6, seed=8)
    off = await engine_of(backend_name, folder, prefix_cache_entries=0, active_prefix_reuse_min_tokens=0)
    donor_want, _ = await run(off, shared, 200, ignore_eos=True)
    recipient_want, _ = await run(off, shared + donor_want[:20] + tail, 10, ignore_eos=True)
    await off.shutdown(1)
    drafts = ScriptedDrafts()
    # the default scope: drafts the donor's first 40 tokens, a run each step; its 160 more, one a step, keep it
    # running (in steps, whatever the machine's speed) while the recipient is placed
    drafts.seen['["", null]'] = [shared + donor_want[:40]]
    on = await engine_of(backend_name, folder, drafts, prefix_cache_entries=0, active_prefix_reuse_min_tokens=8,
                         follow=False)
    donor = on.submit(request(shared, 200, rid="donor", ignore_eos=True))
    got = []
    async for event in donor:
        if hasattr(event, "token"):
            got.append(event.token)
        if len(got) == 24:  # mid-speculation: it drafts a run each step
            break
    recipient, done = await run(on, shared + donor_want[:20] + tail, 10, ignore_eos=True)
    assert done.usage.reuse_source == "donor" and done.usage.reused_tokens >= len(shared)
    assert recipient == recipient_want
    rest, _ = await collect(donor)
    assert got + rest == donor_want
    assert counted(on)[1] > 0
    await on.shutdown(1)


async def test_cancel_mid_verification_leaves_no_kv(backend_name, tiny_model_dir):
    folder = tiny_model_dir("gemma3")
    drafts = ScriptedDrafts()
    p = prompt(30, seed=9)
    on = await engine_of(backend_name, folder, drafts, prefix_cache_entries=0)
    if not on.backend.rolls_back:
        folder = tiny_model_dir("llama")
        await on.shutdown(1)
        on = await engine_of(backend_name, folder, drafts, prefix_cache_entries=0)
    full, _ = await run(on, p, 200, ignore_eos=True)
    handle = on.submit(request(p, 200, ignore_eos=True))  # drafts its whole output, step by step
    async for event in handle:
        if hasattr(event, "token"):
            handle.cancel()
        else:
            assert event.finish_reason == "cancelled"
    await settled(on, on.backend)
    assert on.backend.live_sessions() == 0 and on.backend.total_bytes() == 0
    again, _ = await run(on, p, 200, ignore_eos=True)
    assert again == full
    await on.shutdown(1)


async def test_a_broken_drafter_fails_soft(backend_name, tiny_model_dir, caplog):
    folder, p = tiny_model_dir("llama"), prompt(20, seed=11)
    off = await engine_of(backend_name, folder)
    want, _ = await run(off, p, 10, ignore_eos=True)
    await off.shutdown(1)
    on = await engine_of(backend_name, folder, ScriptedDrafts(raises=True))
    got, done = await run(on, p, 10, ignore_eos=True)
    assert got == want and done.finish_reason == "length"
    await on.shutdown(1)


async def test_plans_with_drafts_replay_on_a_fresh_backend_to_the_same_tokens(backend_name, tiny_model_dir):
    """Verification is part of the step plan: its verify passes and roll backs (Truncate ops) run
    again from the recorded plans alone, to the same tokens."""
    from kvfork.backends import effects as e
    from kvfork.server.engine.worker import plan as p

    folder = tiny_model_dir("llama")
    plans, rids, want = await drafted_plans(create_backend(backend_name), folder,
                                            [prompt(20, seed=12), prompt(26, seed=13)])
    assert any(isinstance(op, e.Truncate) for plan in plans for op in plan.ops)
    fresh = create_backend(backend_name)
    fresh.load(folder, "float32")
    replayed = p.replay([p.from_bytes(p.to_bytes(plan)) for plan in plans], fresh)
    assert [replayed[rid] for rid in rids] == want


async def test_rows_whose_drafts_are_all_rejected_draft_only_to_probe(backend_name, tiny_model_dir):
    """The batch-level policy (draft_policy.py): four requests whose drafter proposes a token the model
    never picks stop drafting after their first few drafts, but for a probe every PROBE_EVERY steps,
    whatever the steps' timings; their tokens are those of speculation off."""
    from kvfork.server.engine.policy.draft_policy import PROBE_EVERY

    folder, n = tiny_model_dir("llama"), 64
    prompts = [prompt(20, seed=30 + i) for i in range(4)]
    off = await engine_of(backend_name, folder, prefix_cache_entries=0)
    want = await asyncio.gather(*(run(off, q, n, ignore_eos=True) for q in prompts))
    await off.shutdown(1)
    never = next(t for t in range(500) if all(t not in tokens for tokens, _ in want))
    on = await engine_of(backend_name, folder, ScriptedDrafts(fixed=[never]), prefix_cache_entries=0)
    if not on.backend.rolls_back:
        pytest.skip(f"{backend_name} does not speculate on llama")
    got = await asyncio.gather(*(run(on, q, n, ignore_eos=True) for q in prompts))
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    drafted, accepted = counted(on)
    assert accepted == 0 and 4 <= drafted <= 4 * (n // PROBE_EVERY + 4)  # one a step would be 4 * (n - 1)
    await on.shutdown(1)


async def test_no_row_drafts_in_a_step_that_prefills(backend_name, tiny_model_dir):
    """A request whose drafts are all accepted decodes without drafts while another's prompt is
    prefilled beside it (drafted positions would lengthen the step that prompt waits on), and drafts
    once it is in; the tokens are those it decodes alone."""
    folder, plans = tiny_model_dir("llama"), []
    settings = dict(prefix_cache_min_tokens=8, kv_budget_bytes=1 << 30, prefill_chunk=16, prefix_cache_entries=0)
    engine = Engine(create_backend(backend_name), folder, "float32", EngineConfig(**settings), Registry(),
                    plans=plans.append, drafts=ScriptedDrafts(spoil_every=0))
    await engine.start()
    if not engine.backend.rolls_back:
        pytest.skip(f"{backend_name} does not speculate on llama")
    p, other = prompt(12, seed=40), prompt(120, seed=41)  # one chunk; eight chunks of 16
    want, _ = await run(engine, p, 150, ignore_eos=True)  # its output seeds the drafter: drafts are then accepted
    plans.clear()
    (got, _), _ = await asyncio.gather(run(engine, p, 150, ignore_eos=True), run(engine, other, 4, ignore_eos=True))
    assert got == want
    await engine.shutdown(1)
    drafting = [any(row.reads > 1 for row in plan.decode) for plan in plans]
    assert not any(d and plan.prefill for d, plan in zip(drafting, plans))
    mixed = [i for i, plan in enumerate(plans) if plan.prefill and plan.decode]
    assert mixed and any(drafting[mixed[-1] + 1:])  # it decoded beside the prefill, and drafted after


async def test_a_padded_pass_trims_its_drafts_to_one_length_and_a_ragged_one_keeps_them(backend_name, tiny_model_dir,
                                                                                        monkeypatch):
    """Draft lengths follow the verify pass's layout (draft_policy.py): on a backend whose pass pads every
    row to the longest (`pads_verify`, MLX) each step's drafts are the drafter's proposals trimmed to one
    length; on a ragged one (torch) every proposal is verified whole, as before the layout was known. The
    tokens are those of each request alone."""
    folder, plans, proposed = tiny_model_dir("llama"), [], {}
    drafts = ScriptedDrafts(spoil_every=2)
    engine = Engine(create_backend(backend_name), folder, "float32",
                    EngineConfig(**dict(TEST_CONFIG, prefill_chunk=16, prefix_cache_entries=0)), Registry(),
                    plans=plans.append, drafts=drafts)
    await engine.start()
    if not engine.backend.rolls_back:
        pytest.skip(f"{backend_name} does not speculate on llama")
    prompts, lengths = [prompt(12, seed=50 + i) for i in range(3)], [14, 22, 30]
    want = [(await run(engine, q, n, ignore_eos=True))[0] for q, n in zip(prompts, lengths)]  # seeds the drafter
    plans.clear()
    propose = RequestDrafts.propose

    def recorded(self, output, limit):
        draft = propose(self, output, limit)
        if draft is not None:
            proposed.setdefault(len(plans), []).append(len(draft.tokens))
        return draft

    monkeypatch.setattr(RequestDrafts, "propose", recorded)
    got = await asyncio.gather(*(run(engine, q, n, ignore_eos=True) for q, n in zip(prompts, lengths)))
    await engine.shutdown(1)
    assert [tokens for tokens, _ in got] == want
    for i, plan in enumerate(plans):
        drafted = sorted(row.reads - 1 for row in plan.decode if row.reads > 1)
        longest = max(drafted, default=0)
        if engine.backend.pads_verify:
            assert drafted == sorted(n for d in proposed.get(i, []) if (n := min(d, longest)) > 0), i
        else:
            assert drafted == sorted(proposed.get(i, [])), i
    assert any(len(set(d)) > 1 for d in proposed.values())  # some step's proposals differed in length
