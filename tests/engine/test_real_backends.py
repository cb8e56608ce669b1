"""The engine on the real backends (MLX and torch) with each tiny architecture, in float32.

Every engine feature runs here once on real model state: batching, capture and
prefix-cache reuse (gemma3's sliding window makes capture timing matter), warm
resume, cancellation and shutdown, queueing, seeded sampling, logprobs. Then active
reuse and following: a recipient served from a donor's state produces exactly the
greedy tokens it would without reuse, and the donor's own tokens are unchanged.
"""

import asyncio

from backend_fixtures import backend_name, prompt  # noqa: F401  (fixture: each importable backend)
from engine_harness import WHOLE_PROMPTS, collect, real_engine, references, request, run, settled
from scripted_backend import Gate
from kvfork.backends.base import SamplingParams
from kvfork.server.engine.policy.matching import common_prefix


async def test_batched_requests_equal_lone_runs_and_the_cache_serves_exactly(backend_name, arch, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir(arch), prefill_chunk=16)
    prompts = [prompt(40 + 3 * i, seed=i) for i in range(3)]
    alone = [await run(engine, p, 12) for p in prompts]  # each one alone; each is captured
    assert all(done.usage.reused_tokens == 0 for _, done in alone)
    together = await asyncio.gather(*(run(engine, p, 12) for p in prompts))
    for (cold, _), (warm, done) in zip(alone, together):
        assert warm == cold
        assert (done.usage.reuse_source, done.usage.reused_tokens) == ("cache", done.usage.prompt_tokens - 1)
    await settled(engine, engine.backend)
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


async def test_warm_resume_equals_a_cold_run(backend_name, arch, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir(arch), **WHOLE_PROMPTS, prefix_cache_entries=0)
    first = prompt(30, seed=7)
    out, _ = await run(engine, first, 10, session_id="chat")
    follow_up = first + out + prompt(12, seed=8)
    warm, done = await run(engine, follow_up, 10, session_id="chat")
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("session", 39)
    cold, cold_done = await run(engine, follow_up, 10)
    assert warm == cold and cold_done.usage.reused_tokens == 0
    await engine.shutdown(1)


async def test_cancel_mid_decode_and_shutdown_release_everything(backend_name, arch, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir(arch), **WHOLE_PROMPTS)
    keep = prompt(20, seed=3)
    reference, _ = await run(engine, keep, 20)
    await settled(engine, engine.backend)
    baseline = engine.backend.live_sessions()
    doomed = engine.submit(request(prompt(25, seed=4), 10_000, rid="doomed"))
    survivor = engine.submit(request(keep, 20, rid="survivor"))
    async for event in doomed:
        if hasattr(event, "token"):
            doomed.cancel()
        else:
            assert event.finish_reason == "cancelled"
    tokens, done = await collect(survivor)
    assert tokens == reference and done.usage.reuse_source == "cache"
    await settled(engine, engine.backend)
    assert engine.backend.live_sessions() == baseline + 1  # the doomed prompt's snapshot is kept
    stuck = engine.submit(request(prompt(30, seed=5), 10_000))
    await engine.shutdown(0.01)
    assert (await collect(stuck))[1].finish_reason == "cancelled"
    assert engine.backend.live_sessions() == 0


async def test_seeded_sampling_replays_while_batched(backend_name, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir("llama"), **WHOLE_PROMPTS, prefix_cache_entries=0)
    sampling = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    p = prompt(20, seed=1)
    alone, _ = await collect(engine.submit(request(p, 12, sampling=sampling)))
    batched = await asyncio.gather(collect(engine.submit(request(p, 12, sampling=sampling))),
                                   run(engine, prompt(33, seed=2), 12))
    assert batched[0][0] == alone
    await engine.shutdown(1)


async def test_requests_beyond_the_slots_wait_their_turn_exactly(backend_name, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir("qwen3"), inference_slots=2, prefix_cache_entries=0, prefill_chunk=8)
    prompts = [prompt(20 + i, seed=20 + i) for i in range(5)]
    alone = [(await run(engine, p, 6))[0] for p in prompts]
    handles = [engine.submit(request(p, 6)) for p in prompts]
    assert engine.stats().queued == 3  # two slots: the rest wait
    together = await asyncio.gather(*(collect(h) for h in handles))
    assert [tokens for tokens, _ in together] == alone
    await engine.shutdown(1)


async def test_logprobs_and_per_request_settings_while_batched(backend_name, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir("llama"), **WHOLE_PROMPTS, prefix_cache_entries=0)
    with_logprobs = SamplingParams(logprobs=True, top_logprobs=3)
    p = prompt(24, seed=6)
    plain, _ = await run(engine, p, 8)
    handle = engine.submit(request(p, 8, sampling=with_logprobs))
    other = engine.submit(request(prompt(30, seed=7), 8, sampling=SamplingParams(temperature=0.8, seed=3)))
    events = [e async for e in handle]
    await collect(other)
    tokens = [e.token for e in events[:-1]]
    assert tokens == plain  # greedy either way: logprobs change nothing
    for e in events[:-1]:
        assert e.logprob is not None and e.logprob <= 0.0
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0][0] == e.token
    await engine.shutdown(1)


async def test_a_donor_clone_gives_the_tokens_of_a_fresh_prefill(backend_name, arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    donor_prompt = prompt(48, seed=1)
    recipients = [donor_prompt + prompt(6, seed=2)]  # extends the donor's prompt: every arch can serve it
    if arch != "gemma3":  # a shared prefix then a different tail: a decoding sliding-window donor has lost it
        recipients.append(donor_prompt[:40] + prompt(9, seed=3))
    want = await references(backend_name, folder, [donor_prompt] + recipients, 12)
    engine = await real_engine(backend_name, folder, prefix_cache_entries=0, active_prefix_reuse_min_tokens=8, follow=False)
    for recipient, expected in zip(recipients, want[1:]):
        gate = engine.backend.gates["decode"] = Gate()
        donor = engine.submit(request(donor_prompt, 12))
        await asyncio.to_thread(gate.reached.wait, 10)  # the donor's first decode: the loop saw its prompt done
        handle = engine.submit(request(recipient, 12))
        gate.open()
        (donor_tokens, _), (tokens, done) = await asyncio.gather(collect(donor), collect(handle))
        assert donor_tokens == want[0]
        assert tokens == expected
        assert done.usage.reuse_source == "donor"
        assert done.usage.reused_tokens == min(common_prefix(donor_prompt, recipient), len(recipient) - 1)
    await settled(engine, engine.backend)
    assert engine.backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_a_burst_follows_its_leader_exactly(backend_name, arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    shared = prompt(64, seed=4)
    prompts = [shared + prompt(3 + i, seed=10 + i) for i in range(3)]
    want = await references(backend_name, folder, prompts, 10)
    engine = await real_engine(backend_name, folder, prefix_cache_entries=0, active_prefix_reuse_min_tokens=8)
    results = await asyncio.gather(*(run(engine, p, 10) for p in prompts))
    assert [tokens for tokens, _ in results] == want
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results[1:]] == [("donor", 64)] * 2
    assert engine.metrics.prefilled_tokens.get() == 64 + sum(3 + i for i in range(3))
    await settled(engine, engine.backend)
    assert engine.backend.live_sessions() == 0
    await engine.shutdown(1)
