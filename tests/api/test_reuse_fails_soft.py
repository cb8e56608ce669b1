"""Reuse is optional work: a lookup, a choice or a disk entry that raises is logged and counted, and the
request runs from a fresh prefill; the client never sees a 500 because an optimisation broke."""

from __future__ import annotations

import logging

import aiohttp
import pytest

from kvfork.backends import create_backend
from engine_harness import until
from http_daemon import metrics, serving
from kvfork.server.engine.cache.index import Index

PROMPT = list(range(3, 203))  # 200 token ids, over the matching minimum
ENGINE = dict(prefix_cache_min_tokens=64, prefix_cache_disk_bytes=1 << 30, prefix_cache_entries=1)


async def complete(http, url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("backend", ["mlx", "torch"])
async def test_an_index_that_raises_leaves_the_request_to_a_fresh_prefill(tiny_model_dir, backend, monkeypatch,
                                                                           caplog):
    caplog.set_level(logging.ERROR, logger="kvfork.engine")
    async with aiohttp.ClientSession() as http:
        async with serving(tiny_model_dir("llama"), create_backend(backend), engine=ENGINE) as daemon:
            first = await complete(http, daemon.url, PROMPT)
            await until(lambda: daemon.engine.stats().cached == 1)
            reused = await complete(http, daemon.url, PROMPT + [7])
            assert cached(reused) == len(PROMPT)

            def broken(self, tokens, scope, disk=True):
                raise RecursionError("maximum recursion depth exceeded")

            monkeypatch.setattr(Index, "best", broken)
            for _ in range(2):  # counted each time, logged once
                fresh = await complete(http, daemon.url, PROMPT + [7])
                assert cached(fresh) == 0 and fresh["choices"][0]["text"] == reused["choices"][0]["text"]
            monkeypatch.undo()
            assert (await metrics(http, daemon.url))['kvfork_reuse_errors_total{stage="placement"}'] == 2
            assert cached(await complete(http, daemon.url, PROMPT + [7])) == len(PROMPT)  # and reuse goes on
            assert first["choices"][0]["text"]
    logged = [r for r in caplog.records if "reuse failed (placement)" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


async def test_a_disk_entry_whose_use_raises_is_dropped_and_never_served_again(tiny_model_dir, monkeypatch):
    from dataclasses import replace

    from kvfork.backends.base import SavedState
    from kvfork.server.engine.policy import placement, restore

    def choose(upto, nbytes, memory, rates, prefilling):  # restore, whatever the tiny model's prefill costs
        return restore.choose_restore(upto, nbytes, memory, replace(rates, prefill_tps=1.0), prefilling)

    monkeypatch.setattr(placement, "choose_restore", choose)
    async with aiohttp.ClientSession() as http:
        async with serving(tiny_model_dir("llama"), create_backend("torch"), engine=ENGINE) as daemon:
            await complete(http, daemon.url, PROMPT)
            await complete(http, daemon.url, [9] * 100)  # pushes PROMPT out of memory, onto disk
            await until(lambda: daemon.engine.stats().on_disk == 1 and daemon.engine.stats().spilling == 0)

            def broken(self, upto):
                raise ValueError("a state that disagrees with its file")

            monkeypatch.setattr(SavedState, "prefix", broken)
            assert cached(await complete(http, daemon.url, PROMPT + [7])) == 0
            assert tuple(PROMPT) not in [e.tokens for e in daemon.engine.serving.index.entries("disk")]  # never again
            found = await metrics(http, daemon.url)
            assert found['kvfork_reuse_errors_total{stage="disk"}'] == 1
            assert found['kvfork_prefix_cache_disk_restores_total{outcome="corrupt"}'] == 1
