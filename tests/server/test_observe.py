"""Observability in the field's terms (server/watch/observe.py): vLLM's metric names and units with its
model_name label, the stats line while busy, and the access log (server/launch/app.py)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from agent_server import agent_model  # noqa: F401 (fixture)
from http_daemon import chat_body, metrics, serving
from kvfork.server.watch.observe import Totals, log_stats, stats_line


class Load:
    running, waiting, kv_usage = 0, 0, 0.0


class Idle:
    def utilization(self):
        return Load()


def test_an_idle_interval_says_nothing_and_a_busy_one_says_its_rates():
    before = Totals(at=100.0, prefilled=0, generated=0, prompt=0, reused=0)
    assert stats_line(before, before, Idle()) is None
    after = Totals(at=110.0, prefilled=300, generated=50, prompt=400, reused=100)
    line = stats_line(before, after, Idle())
    assert line == ("prompt throughput 30.0 tokens/s, generation throughput 5.0 tokens/s, running 0, waiting 0, "
                    "KV in use 0.0%, prefix cache hit rate 25.0% (tokens)")


async def test_vllm_s_names_count_tokens_under_the_model_name(agent_model):
    async with serving(agent_model, served_model_name=["tiny"]) as daemon, aiohttp.ClientSession() as http:
        body = chat_body("a question about the prefix cache and its hit rate in tokens " * 3, max_tokens=2)
        usages = []
        for _ in range(2):
            async with http.post(daemon.url + "/v1/chat/completions", json=body) as r:
                usages.append((await r.json())["usage"])
        seen = await metrics(http, daemon.url)
    label = '{model_name="tiny"}'
    assert seen["kvfork_prefix_cache_queries_total" + label] == sum(u["prompt_tokens"] for u in usages)
    hits = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert hits > 0 and seen["kvfork_prefix_cache_hits_total" + label] == hits
    assert seen['kvfork_prefix_cache_admissions_total{outcome="hit"}'] == 1  # admissions, kvfork's own name
    assert seen["kvfork_num_requests_running" + label] == 0 and seen["kvfork_num_requests_waiting" + label] == 0


@pytest.mark.parametrize("on", [True, False])
async def test_the_access_log_has_a_line_per_request_unless_turned_off(agent_model, caplog, on):
    caplog.set_level(logging.INFO, logger="kvfork.access")
    async with serving(agent_model, served_model_name=["tiny"], access_log=on) as daemon, \
            aiohttp.ClientSession() as http:
        async with http.get(daemon.url + "/v1/models") as r:
            assert r.status == 200
        async with http.post(daemon.url + "/v1/chat/completions", json={"messages": []}) as r:
            assert r.status == 400
        await asyncio.sleep(0.05)  # aiohttp logs once the response is written
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "kvfork.access"]
    if not on:
        assert lines == []
        return
    assert any('"GET /v1/models HTTP/1.1" 200' in line for line in lines)
    assert any('"POST /v1/chat/completions HTTP/1.1" 400' in line for line in lines)


async def test_the_stats_line_comes_while_busy(agent_model, caplog):
    caplog.set_level(logging.INFO, logger="kvfork.stats")
    async with serving(agent_model, served_model_name=["tiny"], log_stats=False) as daemon, \
            aiohttp.ClientSession() as http:
        stats = asyncio.create_task(log_stats(daemon.engine, interval_s=0.05))
        try:
            await asyncio.sleep(0.2)  # idle: nothing
            assert not [r for r in caplog.records if r.name == "kvfork.stats"]
            async with http.post(daemon.url + "/v1/chat/completions", json=chat_body(max_tokens=8)) as r:
                assert r.status == 200
            await asyncio.sleep(0.2)
        finally:
            stats.cancel()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvfork.stats"]
    assert lines and "generation throughput" in lines[0] and "prefix cache hit rate" in lines[0]
