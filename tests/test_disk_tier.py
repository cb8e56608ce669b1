"""The prefix cache's disk tier (server/engine/disk.py): restart, safety, corrupt files, the cost model.

Every test runs under its own KVFORK_HOME (conftest.py); engines here get the tier folder explicitly."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from backends import create_backend
from engine_harness import collect, prompt_of, request, run, until
from server.engine.config import EngineConfig
from server.engine.disk import SUFFIX, DiskTier, kv_root
from server.engine.engine import Engine
from server.engine.rates import Rates
from server.engine.restore import choose_restore
from server.metrics import Registry

CONFIG = dict(prefix_cache_min_tokens=8, kv_budget_bytes=1 << 30, prefix_cache_disk_bytes=1 << 30)


async def start(model: str, backend_name: str = "torch", dtype: str = "float32", **config) -> Engine:
    engine = Engine(create_backend(backend_name), model, dtype, EngineConfig(**{**CONFIG, **config}), Registry(),
                    kv_dir=kv_root())
    await engine.start()
    return engine


def files(engine_or_dir) -> list[Path]:
    folder = engine_or_dir.admission.disk.folder if isinstance(engine_or_dir, Engine) else engine_or_dir
    return sorted(p for p in folder.iterdir() if p.name.endswith(SUFFIX))


async def spill_and_stop(model: str, prompt: list[int], backend_name: str = "torch", **config) -> list[int]:
    """A daemon that computes `prompt`, then shuts down (its cache spills): its greedy tokens."""
    engine = await start(model, backend_name, **config)
    tokens, done = await run(engine, prompt, 6)
    assert done.finish_reason == "length"
    folder = engine.admission.disk.folder
    await engine.shutdown(1.0)
    assert files(folder), "the cache entry was written at shutdown"
    return tokens


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_restart_restores_an_entry_with_the_same_tokens(tiny_model_dir, arch, backend_name):
    model = tiny_model_dir(arch)
    prompt = prompt_of(80)
    fresh = await spill_and_stop(model, prompt, backend_name)
    engine = await start(model, backend_name)
    try:
        assert len(engine.admission.disk.index) == 1  # rebuilt from the headers
        tokens, done = await run(engine, prompt, 6)
        assert done.usage.reuse_source == "disk" and done.usage.reused_tokens == len(prompt) - 1
        assert tokens == fresh
        # a longer prompt sharing it is served from it too (a prefix of the saved state)
        longer = prompt[:50] + prompt_of(30, 99)
        expected = await spill_and_stop_reference(model, longer, backend_name)
        got, done = await run(engine, longer, 6)
        assert got == expected
        assert engine.metrics.disk_restores.get(outcome="restored") >= 1
    finally:
        await engine.shutdown(1.0)


async def spill_and_stop_reference(model: str, prompt: list[int], backend_name: str) -> list[int]:
    """Greedy tokens with no reuse at all, on a separate engine without a disk tier."""
    engine = Engine(create_backend(backend_name), model, "float32",
                    EngineConfig(**{**CONFIG, "prefix_cache_entries": 0, "active_prefix_reuse_min_tokens": 0}),
                    Registry())
    await engine.start()
    try:
        return (await run(engine, prompt, 6))[0]
    finally:
        await engine.shutdown(1.0)
