"""The engine on a hybrid model (Qwen3.5: Gated DeltaNet beside full attention), every reuse path
on, against reuse off (float32): the same greedy tokens, and no error where a reuse is refused.

A recurrent state serves a clone only at its position or at a checkpoint (base.py's recurrent rule),
so the engine plans for it: the prefix cache snapshots a prompt one token before its end (where an
identical prompt's match stops), a running request keeps checkpoints at its last message boundaries,
a leader's chunk stops at its followers' target, and a named session resumes at its own end."""

import asyncio

import numpy as np
import pytest

from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from backends import create_backend
from engine_harness import run, settled
from server.engine.config import EngineConfig
from server.engine.engine import Engine
from server.metrics import Registry

OFF = dict(prefix_cache_entries=0, active_prefix_reuse_min_tokens=0)
ON = dict(prefix_cache_entries=8, active_prefix_reuse_min_tokens=8)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


async def engine_on(name: str, folder: str, **config) -> Engine:
    settings = dict(kv_budget_bytes=1 << 30, prefill_chunk=16, prefix_cache_min_tokens=8, **config)
    engine = Engine(create_backend(name), folder, "float32", EngineConfig(**settings), Registry())
    await engine.start()
    return engine


@pytest.fixture
def folder(backend_name, tiny_hybrid_dir) -> str:
    return tiny_hybrid_dir("qwen3_5")


async def test_prefix_cache_on_a_hybrid_serves_the_snapshot_one_token_short(backend_name, folder):
    first = prompt(40, seed=1)
    # The same prompt again, an extension, and one that leaves the cached prompt at 30.
    prompts = [first, first, first + prompt(9, seed=2), first[:30] + prompt(9, seed=3)]
    off = await engine_on(backend_name, folder, **OFF)
    want = [(await run(off, p, 10))[0] for p in prompts]
    await off.shutdown(1)
    engine = await engine_on(backend_name, folder, **ON)
    served = []
    for p, expected in zip(prompts, want):
        tokens, done = await run(engine, p, 10)
        assert tokens == expected and done.finish_reason in ("length", "stop")
        served.append((done.usage.reuse_source, done.usage.reused_tokens))
    # The snapshot holds [0, 39): the identical prompt and the extension are served there; the
    # prompt leaving it at 30 finds no state held at 30 or below, so nothing is offered or refused.
    assert served == [(None, 0), ("cache", 39), ("cache", 39), (None, 0)]
    assert engine.metrics.clone_refusals.get(source="cache", reason="recurrent_position") == 0
    await settled(engine, engine.backend)
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


async def test_a_burst_on_a_hybrid_gives_the_tokens_of_reuse_off(backend_name, folder):
    shared = prompt(64, seed=4)
    prompts = [shared + prompt(3 + i, seed=10 + i) for i in range(3)]
    off = await engine_on(backend_name, folder, **OFF)
    want = [(await run(off, p, 10))[0] for p in prompts]
    await off.shutdown(1)
    engine = await engine_on(backend_name, folder, **ON)
    results = await asyncio.gather(*(run(engine, p, 10) for p in prompts))
    assert [tokens for tokens, _ in results] == want
    # The leader's chunk stops at the followers' target: the clone runs at its position.
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results[1:]] == [("donor", 64)] * 2
    await settled(engine, engine.backend)
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


async def test_a_named_session_on_a_hybrid_resumes_exactly(backend_name, folder):
    engine = await engine_on(backend_name, folder, **ON)
    first = prompt(30, seed=7)
    out, _ = await run(engine, first, 10, session_id="chat")
    follow_up = first + out + prompt(12, seed=8)
    warm, done = await run(engine, follow_up, 10, session_id="chat")
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("session", 39)
    await engine.shutdown(1)
    off = await engine_on(backend_name, folder, **OFF)
    cold, _ = await run(off, follow_up, 10)
    assert warm == cold
    await off.shutdown(1)
