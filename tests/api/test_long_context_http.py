"""Prompts as long as agents send, over HTTP: a cached prompt of 20k, 64k or 128k tokens, then requests
that leave it near its start, in its middle and near its end, then the same after a restart (the disk
tier). Each gets 200, with reuse wherever the shared part reaches the matching minimum. All in the long
tier (the fast tier has the index's own walk at 200k, tests/engine/test_index.py); one prefill per case
serves the partings of every length up to it (torch's 128k prompt those of a 64k one too). Stored at int8 and
int4 (heads 64 wide), a prompt leaving a 100k-token cached one near its end answers as with reuse off, before and
after a restart.

The index walked the trie below the point where a prompt leaves a cached one by recursion, one level per
16-token block: a cached prompt running ~15.5k tokens past that point raised RecursionError, a 500 for
every later request sharing its start, and the disk tier brought the entry back after a restart."""

from __future__ import annotations

import random

import aiohttp
import pytest

from kvfork.backends import create_backend
from engine_harness import until
from http_daemon import metrics, reuse_off, serving
from kvfork.tools.long_prompts import MIN_TOKENS, partings
from tiny_models import LONG_CONTEXT, write_model

VOCAB = 500  # token ids drawn below it, past the special tokens
ENGINE = dict(kv_budget_bytes=1 << 30, prefix_cache_min_tokens=MIN_TOKENS, prefix_cache_disk_bytes=1 << 30)


pytestmark = pytest.mark.usefixtures("disk_beats_prefill")  # conftest.py: the tier is worth reading


async def completion(http, url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def complete(http, url: str, prompt: list[int]) -> int:
    """A completion of token ids; its cached_tokens."""
    return (await completion(http, url, prompt))["usage"]["prompt_tokens_details"]["cached_tokens"]


async def cached_everywhere(http, url: str, cases: dict) -> dict[str, int]:
    """Each case's cached_tokens; the lookups never fell back (reuse failing soft would hide a broken index)."""
    out = {name: await complete(http, url, prompt) for name, (prompt, _) in cases.items()}
    failed = {k: v for k, v in (await metrics(http, url)).items() if k.startswith("kvfork_reuse_errors_total")}
    assert not any(failed.values()), failed
    return out


@pytest.mark.long
@pytest.mark.parametrize("backend,length,shorter", [
    pytest.param("mlx", 20_000, (), id="mlx-20k"), pytest.param("torch", 20_000, (), id="torch-20k"),
    pytest.param("mlx", 64_000, (), id="mlx-64k"),
    pytest.param("torch", 128_000, (64_000,), id="torch-128k-and-64k"),
])
async def test_prompts_leaving_a_long_cached_one_reuse_it_before_and_after_a_restart(long_context_model, backend,
                                                                                     length, shorter):
    rng = random.Random(length)
    long = [rng.randrange(3, VOCAB) for _ in range(length)]
    # new tails after the restart: no prompt of the first round
    cases, after_restart = partings(long, rng, VOCAB, shorter), partings(long, rng, VOCAB, shorter)
    want = {name: cached for name, (_, cached) in cases.items()}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        async with serving(long_context_model, create_backend(backend), engine=ENGINE) as daemon:
            assert await complete(http, daemon.url, long) == 0
            await until(lambda: daemon.engine.stats().cached == 1)  # its snapshot is in the cache
            assert await cached_everywhere(http, daemon.url, cases) == want
        async with serving(long_context_model, create_backend(backend), engine=ENGINE) as daemon:  # a restart
            assert daemon.engine.stats().on_disk >= 1  # the cache went to disk at shutdown
            assert await cached_everywhere(http, daemon.url, after_restart) == want


@pytest.mark.long
@pytest.mark.parametrize("backend,dtype,length", [("torch", "int4", 100_000), ("mlx", "int8", 64_000)])
async def test_a_long_prompt_stored_quantized_answers_as_reuse_off(tmp_path, kvfork_home, backend, dtype, length):
    model = str(write_model(tmp_path / "model", "llama", **dict(LONG_CONTEXT, head_dim=64)))
    engine = dict(ENGINE, kv_cache_dtype=dtype)
    rng = random.Random(length)
    long = [rng.randrange(3, VOCAB) for _ in range(length)]
    leaving = long[:length - 40] + [rng.randrange(3, VOCAB) for _ in range(64)]

    async def texts(http, url: str, **extra) -> tuple[str, int]:
        reply = await completion(http, url, leaving, max_tokens=6, ignore_eos=True, **extra)
        return reply["choices"][0]["text"], reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        async with serving(model, create_backend(backend), engine=engine) as daemon:
            assert daemon.engine.info.kv_dtype.startswith(dtype)
            await completion(http, daemon.url, long)
            await until(lambda: daemon.engine.stats().cached == 1)
            cold, reused = await texts(http, daemon.url, **reuse_off("long-prompt"))
            assert reused == 0
            warm, reused = await texts(http, daemon.url)
            assert reused >= length - 40 - 16 and warm == cold
        async with serving(model, create_backend(backend), engine=engine) as daemon:  # a restart: from disk
            restored, reused = await texts(http, daemon.url)
            assert reused >= length - 40 - 16 and restored == cold
