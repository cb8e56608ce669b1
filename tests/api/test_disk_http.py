"""The disk tier over HTTP: a disk hit reported as cached_tokens, kept per tenant, across a restart;
--prefix-cache-warm; `kvfork cache ls / clear`. On a tiny real model, under a temporary KVFORK_HOME."""

from __future__ import annotations

import json
import logging

import aiohttp
import pytest

from engine_harness import until
from http_daemon import serving
from kvfork.server.cli import main as kvfork

CHAT = "/v1/chat/completions"
PROMPT = "a long shared system prompt that every request here sends, word for word, " * 3
KEYS = "key-a tenant-a\nkey-b tenant-b\n"
ONE_ENTRY = dict(prefix_cache_entries=1, prefix_cache_disk_bytes=1 << 30)  # each new prompt spills the last


async def cached(http, daemon, text: str = PROMPT, key: str | None = None) -> int:
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(daemon.url + CHAT, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def spilled(daemon) -> None:
    await until(lambda: daemon.engine.stats().spilling == 0)


pytestmark = pytest.mark.usefixtures("disk_beats_prefill")  # conftest.py: the tier is worth reading


async def test_an_evicted_prompt_comes_back_from_disk_then_after_a_restart(tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="kvfork.requests")
    model = tiny_model_dir("llama")
    async with aiohttp.ClientSession() as http:
        async with serving(model, engine=ONE_ENTRY) as daemon:
            assert await cached(http, daemon) == 0
            assert await cached(http, daemon, "something else entirely, long enough to be kept " * 3) == 0
            await spilled(daemon)  # the first prompt left memory for disk
            assert daemon.engine.stats().on_disk == 1
            assert await cached(http, daemon) > 0
        lines = [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records if r.name == "kvfork.requests"]
        assert lines[-1]["reuse_source"] == "disk" and lines[-1]["disk"] == "restore"
        assert lines[-1]["disk_restore_s"] < lines[-1]["disk_recompute_s"]
        async with serving(model, engine=ONE_ENTRY) as daemon:  # a restart: the files are the index
            assert await cached(http, daemon) > 0
            metrics = await (await http.get(daemon.url + "/metrics")).text()
            assert 'kvfork_prefix_cache_disk_restores_total{outcome="restored"} 1' in metrics


async def test_a_disk_entry_serves_its_own_tenant_only(tiny_model_dir, keys_file):
    model = tiny_model_dir("llama")
    async with aiohttp.ClientSession() as http:
        async with serving(model, engine=ONE_ENTRY, api_keys_file=keys_file) as daemon:
            assert await cached(http, daemon, key="key-a") == 0
        async with serving(model, engine=ONE_ENTRY, api_keys_file=keys_file) as daemon:
            assert await cached(http, daemon, key="key-b") == 0  # tenant a's file, tenant b's request: cold
            assert await cached(http, daemon, key="key-a") > 0


async def test_warm_prompts_are_computed_at_start_in_their_scope(tiny_model_dir, keys_file, tmp_path):
    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps([[{"role": "user", "content": PROMPT}],
                                {"messages": [{"role": "user", "content": PROMPT + "!"}], "tenant": "tenant-b"}]))
    model = tiny_model_dir("llama")
    async with aiohttp.ClientSession() as http:
        async with serving(model, prefix_cache_warm=str(warm)) as daemon:
            assert await cached(http, daemon) > 0  # the default scope's, warm before the first request
        async with serving(model, prefix_cache_warm=str(warm), api_keys_file=keys_file) as daemon:
            assert await cached(http, daemon, PROMPT + "!", key="key-b") > 0
            assert await cached(http, daemon, PROMPT + "!", key="key-a") == 0


def test_cache_ls_and_clear(tiny_model_dir, capsys, kvfork_home):
    import asyncio

    async def fill():
        async with aiohttp.ClientSession() as http:
            async with serving(tiny_model_dir("llama")) as daemon:
                await cached(http, daemon)

    asyncio.run(fill())
    assert kvfork(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "1 model fingerprint(s)" in out and "1 entries" in out
    assert kvfork(["cache", "clear"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not any((kvfork_home / "kv").iterdir())
    assert kvfork(["cache", "ls"]) == 0
    assert "0 model fingerprint(s)" in capsys.readouterr().out
