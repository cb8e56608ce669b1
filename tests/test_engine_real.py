"""The engine on the real backends (MLX and torch) with each tiny architecture, in float32.

Every engine feature runs here once on real model state: batching, capture and
prefix-cache reuse (gemma3's sliding window makes capture timing matter), warm
resume, cancellation and shutdown, queueing, seeded sampling, logprobs.
"""

import asyncio

import numpy as np

from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from kvfork.backends import create_backend
from kvfork.backends.base import SamplingParams
from engine_harness import collect, request, run, settled
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.engine import Engine
from kvfork.server.metrics import Registry


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


async def real_engine(name: str, folder: str, **config) -> Engine:
    settings = dict(prefix_cache_min_tokens=8, kv_budget_bytes=1 << 30, max_tokens=16)
    engine = Engine(create_backend(name), folder, "float32", EngineConfig(**{**settings, **config}), Registry())
    await engine.start()
    return engine


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
    engine = await real_engine(backend_name, tiny_model_dir(arch), prefix_cache_entries=0)
    first = prompt(30, seed=7)
    out, _ = await run(engine, first, 10, session_id="chat")
    follow_up = first + out + prompt(12, seed=8)
    warm, done = await run(engine, follow_up, 10, session_id="chat")
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("session", 39)
    cold, cold_done = await run(engine, follow_up, 10)
    assert warm == cold and cold_done.usage.reused_tokens == 0
    await engine.shutdown(1)


async def test_cancel_mid_decode_and_shutdown_release_everything(backend_name, arch, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir(arch))
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
    engine = await real_engine(backend_name, tiny_model_dir("llama"), prefix_cache_entries=0)
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
    assert engine.snapshot().queued == 3  # two slots: the rest wait
    together = await asyncio.gather(*(collect(h) for h in handles))
    assert [tokens for tokens, _ in together] == alone
    await engine.shutdown(1)


async def test_logprobs_and_per_request_settings_while_batched(backend_name, tiny_model_dir):
    engine = await real_engine(backend_name, tiny_model_dir("llama"), prefix_cache_entries=0)
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
