"""Hostile bodies, second round (issue 33, findings 11-16): no body gets a 500 or a dropped connection, a
client's string never reaches a header or forges a log line, and every input is bounded before work."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
from aiohttp import web
from http_daemon import chat_body, serving
from kvfork.server.guard.limits import Limits
from kvfork.server.guard.slow_clients import MIN_DRAINED, SlowClients
from kvfork.server.guard.slow_clients import listen as watched_listen
from kvfork.server.watch.metrics import Registry

CHAT, COMPLETIONS, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"


@pytest.fixture
async def daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=512)) as d:
        yield d


async def answer(http, url: str, body: dict) -> tuple[int, dict, dict]:
    # a stream, not raw bytes: aiohttp warns that a body of megabytes in one write would hold its loop
    data = io.BytesIO(json.dumps(body).encode())
    async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


# ---- 13: logit_bias keys ----


@pytest.mark.parametrize("key", ["--5", "²", "9" * 5000, " 5", "5 ", "+5", "-1", "0x10", "", "٣"])
async def test_a_logit_bias_key_that_is_no_token_id_is_a_400_naming_it(daemon, http, key):
    for path, body in [(CHAT, chat_body(max_tokens=1, logit_bias={key: 1})),
                       (COMPLETIONS, {"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1}})]:
        status, _, reply = await answer(http, daemon.url + path, body)
        assert status == 400, reply
        error = reply["error"]
        assert error["param"] == "logit_bias" and len(error["message"]) < 200
        assert "\n" not in error["message"]


async def test_a_logit_bias_key_in_the_vocabulary_still_biases(daemon, http):
    vocab = daemon.state.engine.info.vocab_size
    status, _, reply = await answer(http, daemon.url + COMPLETIONS,
                                    {"prompt": "hi", "max_tokens": 3, "logit_bias": {"7": 100}})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length"
    status, _, _ = await answer(http, daemon.url + COMPLETIONS,
                                {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(vocab): 1}})
    assert status == 400


# ---- 14, 15: tool types ----


@pytest.mark.parametrize("kind", [123, None, ["web_search"], {"a": 1}])
async def test_a_responses_tool_type_that_is_no_string_is_a_400(daemon, http, kind):
    status, _, reply = await answer(http, daemon.url + RESPONSES, {"input": "hi", "max_output_tokens": 1,
                                                                    "tools": [{"type": kind, "name": "f"}]})
    assert status == 400 and reply["error"]["param"] == "tools[0].type", reply
    namespace = {"type": "namespace", "name": "ns", "tools": [{"type": kind, "name": "f"}]}
    status, _, reply = await answer(http, daemon.url + RESPONSES, {"input": "hi", "max_output_tokens": 1,
                                                                    "tools": [namespace]})
    assert status == 400 and reply["error"]["param"] == "tools[0].tools[0].type", reply


async def test_a_dropped_tool_type_never_reaches_a_header_or_forges_a_log_line(daemon, http, caplog):
    forged = "web_search\r\nX-Forged: 1\n2026-01-01 INFO kvfork.http forged line " + "x" * 1_000_000
    caplog.set_level(logging.INFO, logger="kvfork")
    async with http.get(daemon.url + "/v1/models") as r:
        model = (await r.json())["data"][0]["id"]
    for path, body in [
            (RESPONSES, {"input": "hi", "max_output_tokens": 1, "tools": [{"type": forged}]}),
            (MESSAGES, {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
                        "tools": [{"type": forged, "name": "search"}]})]:
        status, headers, reply = await answer(http, daemon.url + path, body)
        assert status == 200, reply
        assert headers["X-Kvfork-Dropped-Tools"] == "1" and "X-Forged" not in headers
    lines = [r.getMessage() for r in caplog.records if "tools dropped" in r.getMessage()]
    assert len(lines) == 2
    for line in lines:
        assert "\n" not in line and "\r" not in line and len(line) < 500 and "1,000" in line


# ---- 16: --max-tools counts a namespace's functions ----


async def test_max_tools_counts_the_functions_of_a_namespace(daemon, http):
    functions = [{"type": "function", "name": f"f{i}", "parameters": {}} for i in range(300)]
    status, _, reply = await answer(http, daemon.url + RESPONSES, {
        "input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": functions}]})
    assert status == 400 and reply["error"]["param"] == "tools" and "--max-tools" in reply["error"]["message"]
    status, _, reply = await answer(http, daemon.url + RESPONSES, {
        "input": "hi", "max_output_tokens": 1, "tools": [{"type": "namespace", "name": "ns", "tools": functions[:128]}]})
    assert reply["error"]["code"] == "context_length_exceeded", reply  # past the count: 128 functions fit it


# ---- 11: token-id prompts are counted before they are read ----


async def test_token_id_prompts_are_counted_before_they_are_read_or_echoed(daemon, http, monkeypatch):
    decoded: list[int] = []
    tokenizer = daemon.state.tokenizer
    real_decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, *a, **k: decoded.append(len(ids)) or real_decode(ids, *a, **k))
    for prompt in ([1] * 3_000_000, [[1] * 600]):
        status, _, reply = await answer(http, daemon.url + COMPLETIONS,
                                        {"prompt": prompt, "echo": True, "max_tokens": 1})
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert reply["error"]["param"] == "prompt"
    assert decoded == []  # neither echoed nor decoded
    status, _, reply = await answer(http, daemon.url + COMPLETIONS, {"prompt": [1, 2, 3], "echo": True, "max_tokens": 1})
    assert status == 200 and decoded  # the bound lets a prompt in the context through, echoed


# ---- 12: the write watchdog judges progress ----


async def _serve_bytes(size: int, write_timeout: float):
    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * size)

    app = web.Application()
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    clients = SlowClients(Registry(), Limits(write_timeout=write_timeout))
    server = await watched_listen(runner, "127.0.0.1", 0, clients)
    return runner, server, clients


async def _read_slowly(port: int, chunk: int, pause_s: float) -> int:
    """Read the whole reply, `chunk` bytes then a pause at a time; what arrived before the daemon closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=chunk)
    writer.write(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    await writer.drain()
    got = 0
    try:
        while data := await reader.read(chunk):
            got += len(data)
            await asyncio.sleep(pause_s)
    except ConnectionResetError:
        pass
    finally:
        writer.close()
    return got


async def test_a_slow_steady_reader_keeps_its_connection():
    size = 24 * 1024 * 1024  # far past what the kernel's socket buffers hold: the transport's buffer stays full
    runner, server, clients = await _serve_bytes(size, write_timeout=0.5)
    try:
        # drains 40 x MIN_DRAINED per write timeout, over several of them
        got = await asyncio.wait_for(_read_slowly(server.sockets[0].getsockname()[1], 4 * MIN_DRAINED, 0.05), 300)
        assert got > size and clients.write_timeouts.get() == 0
    finally:
        server.close()
        await runner.cleanup()


async def test_a_reader_that_stops_is_cut_off():
    runner, server, clients = await _serve_bytes(24 * 1024 * 1024, write_timeout=0.3)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(b"GET /big HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await reader.readexactly(2 * MIN_DRAINED)  # some, then nothing
        async with asyncio.timeout(60):
            while clients.write_timeouts.get() == 0:
                await asyncio.sleep(0.05)
        writer.close()
    finally:
        server.close()
        await runner.cleanup()


# ---- 4: /v1/loads with --metrics-key ----


async def test_loads_tell_only_counts_without_the_metrics_key(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=512), metrics_key="mkey") as d:
        async with http.post(d.url + CHAT, json=chat_body("the same prompt " * 8, max_tokens=2)) as r:
            assert r.status == 200
        async with http.post(d.url + CHAT, json=chat_body("the same prompt " * 8, max_tokens=2)) as r:
            assert r.status == 200  # reuses the first: the hit rate moves
        async with http.get(d.url + "/v1/loads") as r:
            assert r.status == 200  # smg polls it with no key
            (open_rank,) = (await r.json())["loads"]
        async with http.get(d.url + "/v1/loads", headers={"Authorization": "Bearer mkey"}) as r:
            (full,) = (await r.json())["loads"]
    assert full["cache_hit_rate"] > 0  # the keyed poller sees it move
    for field in ("num_used_tokens", "token_usage", "cache_hit_rate", "num_waiting_uncached_tokens",
                  "gen_throughput"):
        assert open_rank[field] == 0, field
    for field in ("num_running_reqs", "num_waiting_reqs", "max_running_requests", "max_total_num_tokens"):
        assert open_rank[field] == full[field], field
