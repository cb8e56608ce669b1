"""Request shapes through smg: smg re-parses each request into its own types before it forwards it, so a
shape kvfork accepts may be one smg refuses. Each shape goes to a daemon directly and through a real smg in
front of it; the two must answer alike, except the shapes smg refuses itself (SMG_REFUSES, listed in
docs/cluster.md). Also: the headers smg forwards, and kvfork's own body fields (session_id, cache_salt,
top_k ...) reaching the daemon on chat. Skips without smg (pip install '.[cluster]')."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import aiohttp
import pytest

from http_daemon import metrics, serving
from kvfork.tools.bench.serve import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("smg") is None,
                                reason="smg is not installed: pip install '.[cluster]'")

M = "tiny"
USER = [{"role": "user", "content": "the capital of France"}]
TOOL = {"type": "function", "function": {"name": "read_file", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a\"}"}}
ANTHROPIC_TOOL = {"name": "read_file", "description": "read", "input_schema": {"type": "object", "properties": {}}}
FIXTURES = Path(__file__).parents[1] / "fixtures" / "clients"  # the agent clients' recorded shapes, where present

SHAPES = {
    "chat": ("/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": 3}),
    "chat, streamed with usage": ("/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": 3,
                                                          "stream": True, "stream_options": {"include_usage": True}}),
    "chat with tools": ("/v1/chat/completions", {"model": M, "messages": [{"role": "system", "content": "sys"}, *USER],
                                                 "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": True,
                                                 "max_tokens": 3}),
    "chat with a tool call and its result": ("/v1/chat/completions", {"model": M, "tools": [TOOL], "max_tokens": 3,
                                             "messages": [*USER, {"role": "assistant", "content": None,
                                                                  "tool_calls": [CALL]},
                                                          {"role": "tool", "tool_call_id": "c1", "content": "data"}]}),
    "chat, developer role and content parts": ("/v1/chat/completions", {"model": M, "max_completion_tokens": 3,
                                               "messages": [{"role": "developer", "content": "dev"},
                                                            {"role": "user", "content": [{"type": "text",
                                                                                          "text": "hi"}]}]}),
    "chat with kvfork's fields": ("/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": 3,
                                  "session_id": "agent-1", "cache_salt": "salt-1", "top_k": 5, "min_p": 0.1,
                                  "repetition_penalty": 1.1, "chat_template_kwargs": {"enable_thinking": False}}),
    "chat, json_object, n=2, logprobs": ("/v1/chat/completions", {"model": M, "messages": USER, "max_tokens": 3,
                                         "response_format": {"type": "json_object"}, "n": 2, "seed": 1,
                                         "logprobs": True, "top_logprobs": 2}),
    "chat without model": ("/v1/chat/completions", {"messages": USER, "max_tokens": 3}),
    "completions": ("/v1/completions", {"model": M, "prompt": "the capital of", "max_tokens": 3}),
    "completions of token ids": ("/v1/completions", {"model": M, "prompt": [1, 2, 3], "max_tokens": 3}),
    "messages, system blocks with cache_control": ("/v1/messages", {
        "model": M, "max_tokens": 3, "metadata": {"user_id": "u"},
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]}),
    "messages, tool_use and tool_result": ("/v1/messages", {
        "model": M, "max_tokens": 3, "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"},
        "messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file",
                                                               "input": {"path": "a"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "data"}]}]}),
    "messages, streamed, thinking off": ("/v1/messages", {"model": M, "max_tokens": 3, "stream": True,
                                         "thinking": {"type": "disabled"}, "messages": USER}),
    "messages with kvfork's fields": ("/v1/messages", {"model": M, "max_tokens": 3, "messages": USER,
                                      "session_id": "agent-2", "cache_salt": "salt-2"}),
    "messages, system role in messages": ("/v1/messages", {"model": M, "max_tokens": 3, "messages": [
        {"role": "system", "content": "sys"}, *USER]}),
    "count_tokens": ("/v1/messages/count_tokens", {"model": M, "messages": USER}),
    "responses": ("/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 3}),
    "responses, items and tools, streamed": ("/v1/responses", {
        "model": M, "instructions": "be brief", "store": False, "stream": True, "max_output_tokens": 3,
        "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low"},
        "tools": [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}],
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "data"}]}),
    "responses, tool_choice without tools": ("/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 3,
                                             "tool_choice": "auto"}),
    "responses with session_id": ("/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 3,
                                  "session_id": "agent-3"}),
    "responses with cache_salt": ("/v1/responses", {"model": M, "input": "hi", "max_output_tokens": 3,
                                  "cache_salt": "salt-3"}),
}
# What smg 1.13 itself answers 400 to, whatever kvfork says (docs/cluster.md says why each is smg's limit).
SMG_REFUSES = {"chat without model", "completions of token ids", "responses, tool_choice without tools",
               "responses with session_id", "responses with cache_salt"}


def recorded_shapes() -> dict[str, tuple[str, dict]]:
    """The agent clients' recorded requests (tests/fixtures/clients, the real-clients issue), where present."""
    out = {}
    for path in sorted(FIXTURES.glob("*.json")) if FIXTURES.is_dir() else []:
        data = json.loads(path.read_text())
        entries = data.get("requests", []) if isinstance(data, dict) else data
        for i, entry in enumerate(entries):
            if isinstance(entry, dict) and entry.get("method", "POST") == "POST" and isinstance(entry.get("body"), dict):
                out[f"{path.stem} #{i}"] = (entry["path"], {**entry["body"], "model": M})
    return out


@pytest.fixture
async def gateway(tiny_model_dir, tmp_path):
    """(gateway url, daemon): smg in front of one in-process daemon."""
    async with serving(tiny_model_dir("llama"), served_model_name=[M]) as daemon:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", daemon.url, "--policy", "cache_aware", "--sticky-sessions", "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(free_port()), "--disable-tokenizer-autoload",
            "--worker-startup-check-interval", "1", "--shutdown-grace-period-secs", "1",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            cwd=tmp_path)  # smg writes smg.pid where it runs
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(240):
                    try:
                        async with http.get(url + "/workers") as r:
                            if [w["is_healthy"] for w in (await r.json())["workers"]] == [True]:
                                break
                    except (aiohttp.ClientError, KeyError, ValueError):
                        pass
                    await asyncio.sleep(0.25)
                else:
                    raise AssertionError("smg never reported the daemon healthy")
            yield url, daemon
        finally:
            proc.terminate()
            await proc.wait()


async def status_of(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> int:
    async with http.post(url, json=body, headers=headers or {}) as r:
        await r.read()
        return r.status


@pytest.mark.long  # smg and a replica process
async def test_shapes_through_smg(gateway):
    url, daemon = gateway
    recorded = recorded_shapes()
    differ, refused_recorded = {}, set()
    async with aiohttp.ClientSession() as http:
        for name, (path, body) in {**SHAPES, **recorded}.items():
            through, direct = await status_of(http, url + path, body), await status_of(http, daemon.url + path, body)
            if name in SMG_REFUSES:
                if through != 400:
                    differ[name] = f"smg now answers {through}: update SMG_REFUSES and docs/cluster.md"
            elif name in recorded and through == 400 and direct == 200:
                refused_recorded.add(name)  # a client's shape smg refuses: docs/cluster.md should say which
            elif through != direct:
                differ[name] = (through, direct)
    assert not differ, differ
    assert not refused_recorded, refused_recorded


async def test_what_smg_forwards(gateway):
    """The body's session_id reaches the daemon (a named session there); the routing key smg routes on and the
    X-Session-ID header (smg drops it) name none."""
    url, daemon = gateway
    async with aiohttp.ClientSession() as http:
        body = {"model": M, "messages": USER, "max_tokens": 2}
        assert await status_of(http, url + "/v1/chat/completions", body,
                               {"x-smg-routing-key": "conversation-1", "X-Session-ID": "header-session"}) == 200
        assert (await metrics(http, daemon.url))["kvfork_named_sessions"] == 0
        assert await status_of(http, url + "/v1/chat/completions", {**body, "session_id": "agent-9"}) == 200
        assert (await metrics(http, daemon.url))["kvfork_named_sessions"] == 1
