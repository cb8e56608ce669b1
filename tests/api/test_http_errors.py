"""Every error in OpenAI's shape with the status the issue's table gives; no input yields a 500."""

from __future__ import annotations

import json
import random
from contextlib import asynccontextmanager

import aiohttp
import pytest

from http_daemon import TEST_ENGINE, chat_body, serving
from scripted_backend import ScriptedBackend
from kvfork.tools.soak import MALFORMED, fuzz_bodies, fuzz_coding

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


async def error_of(response: aiohttp.ClientResponse) -> dict:
    body = await response.json()
    beside = {"status", "phase"} if response.url.path == "/health" else set()  # /health says where a start is
    assert set(body) == {"error", *beside} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    return body["error"]


async def expect(http, method: str, url: str, status: int, code: str | None, param: str | None = None, **kw) -> dict:
    async with http.request(method, url, **kw) as r:
        assert r.status == status, await r.text()
        error = await error_of(r)
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


@asynccontextmanager
async def long_stream(http, url: str, **extra):
    """A streaming request that runs until we hang up; entered once its first token has arrived."""
    body = chat_body(max_tokens=3000, ignore_eos=True, stream=True, **extra)
    async with http.post(url + CHAT, json=body) as r:
        assert r.status == 200
        async for line in r.content:
            if b'"content":"' in line and b'"role"' not in line:
                break
        yield r
        r.close()


@pytest.fixture
async def daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=256)) as d:
        yield d


async def test_invalid_values_name_the_param(daemon, http):
    url = daemon.url + CHAT
    for bad, param in [({"temperature": 3}, "temperature"), ({"max_tokens": "5"}, "max_tokens"),
                       ({"top_p": 0}, "top_p"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                       ({"stop": 5}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"top_logprobs": 3}, "top_logprobs"),
                       ({"session_id": "x" * 129}, "session_id"), ({"session_id": "tab\there"}, "session_id"),
                       ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage")]:
        error = await expect(http, "POST", url, 400, "invalid_value", param, json=chat_body(**bad))
        assert error["type"] == "invalid_request_error"
    await expect(http, "POST", url, 400, "invalid_value", "messages", json={"model": "x"})
    await expect(http, "POST", url, 400, "invalid_value", "messages[0].role",
                 json={"messages": [{"role": "alien", "content": "hi"}]})
    await expect(http, "POST", url, 400, "invalid_json", None, data=b'{"messages": [')
    await expect(http, "POST", url, 400, "invalid_json", None, data=b"")
    await expect(http, "POST", daemon.url + COMPLETIONS, 400, "invalid_value", "prompt",
                 json={"prompt": [1, 99999]})
    await expect(http, "POST", daemon.url + COMPLETIONS, 400, "invalid_value", "prompt", json={"prompt": ""})


async def test_context_length_exceeded(daemon, http):
    await expect(http, "POST", daemon.url + CHAT, 400, "context_length_exceeded",
                 json=chat_body("the city " * 300))


async def test_unsupported_parameters_and_content(daemon, http):
    url = daemon.url + CHAT
    await expect(http, "POST", url, 400, "integer_above_max_value", "n", json=chat_body(n=9))  # over --max-n (8)
    await expect(http, "POST", url, 400, "invalid_grammar", "response_format.type",
                 json=chat_body(response_format={"type": "yaml"}))
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]}
    await expect(http, "POST", url, 400, "unsupported_content", "messages[0].content[1]", json=image)
    for extra, param in [({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
                         ({"echo": True, "logprobs": 1}, "echo"), ({"prompt": ["a", "b"]}, "prompt")]:
        await expect(http, "POST", daemon.url + COMPLETIONS, 400, "unsupported_parameter", param,
                     json={"prompt": "the city", **extra})
    await expect(http, "POST", daemon.url + COMPLETIONS, 400, "integer_above_max_value", "n", json={"prompt": "x", "n": 9})


async def test_text_parts_and_unknown_fields_are_served(daemon, http):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "the"}, {"type": "text", "text": "city"}]}],
             "max_tokens": 2, "user": "me", "metadata": {"a": 1}, "parallel_tool_calls": False, "store": True,
             "response_format": {"type": "text"}}
    async with http.post(daemon.url + CHAT, json=parts) as r:
        assert r.status == 200


async def test_model_not_found_unless_any_model_is_accepted(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama")) as d:
        await expect(http, "POST", d.url + CHAT, 404, "model_not_found", "model", json=chat_body(model="gpt-4o"))
        await expect(http, "POST", d.url + COMPLETIONS, 404, "model_not_found", "model",
                     json={"prompt": "x", "model": "gpt-4o"})
    async with serving(tiny_model_dir("llama"), accept_any_model=True) as d:
        async with http.post(d.url + CHAT, json=chat_body(model="claude-sonnet", max_tokens=1)) as r:
            assert r.status == 200 and (await r.json())["model"] == "claude-sonnet"


async def test_body_too_large(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), max_body_bytes=2048) as d:
        await expect(http, "POST", d.url + CHAT, 413, "body_too_large", json=chat_body("x" * 4096))
        async with http.post(d.url + CHAT, json=chat_body("the city", max_tokens=1)) as r:
            assert r.status == 200


async def test_api_key(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), api_key=["sekrit"]) as d:
        body = chat_body(max_tokens=1)
        error = await expect(http, "POST", d.url + CHAT, 401, "invalid_api_key", json=body)
        assert error["type"] == "authentication_error"
        await expect(http, "POST", d.url + CHAT, 401, "invalid_api_key", json=body,
                     headers={"Authorization": "Bearer wrong"})
        async with http.get(d.url + "/v1/models") as r:  # open: a gateway (smg) registers replicas by it
            assert r.status == 200
        for headers in ({"Authorization": "Bearer sekrit"}, {"x-api-key": "sekrit"}):
            async with http.post(d.url + CHAT, json=body, headers=headers) as r:
                assert r.status == 200
        async with http.get(d.url + "/health") as r:  # probes need no key
            assert r.status == 200


async def test_not_ready_until_loaded(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), load=False) as d:
        await expect(http, "GET", d.url + "/health", 503, "not_ready")
        await expect(http, "POST", d.url + CHAT, 503, "not_ready", json=chat_body())
        await expect(http, "POST", d.url + "/v1/sessions/a/reset", 503, "not_ready")
        async with http.get(d.url + "/health") as r:
            assert (await r.json())["phase"] == "loading"
        await d.load()
        async with http.get(d.url + "/health") as r:
            body = await r.json()
            assert r.status == 200 and body["status"] == "ok" and body["phase"] == "ready"
            plan = body["memory"]  # the memory plan the KV budget came from
            assert plan["kv_budget_bytes"] == TEST_ENGINE["kv_budget_bytes"] and "--kv-budget-bytes" in plan["reason"]
            assert plan["device"]["weights_bytes"] > 0 and plan["device"]["kind"] in ("cpu", "metal")


async def test_capacity_exhausted(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), engine=dict(inference_slots=1, max_queue=0)) as d:
        async with long_stream(http, d.url):
            await expect(http, "POST", d.url + CHAT, 429, "capacity_exhausted", json=chat_body(max_tokens=1))


async def test_a_busy_session_runs_the_request_without_it_and_only_its_reset_is_refused(daemon, http):
    async with long_stream(http, daemon.url, session_id="busy"):
        async with http.post(daemon.url + CHAT, json=chat_body(max_tokens=1),
                             headers={"X-Kvfork-Session": "busy"}) as r:
            assert r.status == 200  # neither OpenAI nor Anthropic refuses concurrent requests
        await expect(http, "POST", daemon.url + "/v1/sessions/busy/reset", 409, "session_busy")
        await expect(http, "DELETE", daemon.url + "/v1/sessions/busy", 409, "session_busy")
        async with http.post(daemon.url + CHAT, json=chat_body(max_tokens=1, session_id="other")) as r:
            assert r.status == 200


async def test_unknown_routes_and_methods(daemon, http):
    await expect(http, "GET", daemon.url + "/v1/nothing", 404, "not_found")
    await expect(http, "GET", daemon.url + CHAT, 405, "method_not_allowed")
    await expect(http, "POST", daemon.url + "/v1/sessions/nope/reset", 404, "session_not_found")


async def test_no_input_yields_a_500(daemon, http):
    rng = random.Random(0)
    bodies = MALFORMED + fuzz_bodies(rng, 150, chat_body(max_tokens=1))
    for route in (CHAT, COMPLETIONS):
        for data, coding in (fuzz_coding(rng, body) for body in bodies):  # some compressed, or not decodable
            headers = {"Content-Type": "application/json", **({"Content-Encoding": coding} if coding else {})}
            async with http.post(daemon.url + route, data=data, headers=headers) as r:
                text = await r.text()
                assert r.status < 500, (data[:200], text)
                if r.status >= 400:
                    await error_of(r)


async def test_health_is_503_once_the_runner_has_died(tiny_model_dir, http):
    backend = ScriptedBackend()
    backend.fail = lambda kind, sessions, inputs: kind == "load"
    async with serving(tiny_model_dir("llama"), backend, load=False, metrics_key="m-key") as d:
        with pytest.raises(RuntimeError):
            await d.load()
        error = await expect(http, "GET", d.url + "/health", 503, "not_ready")
        why = d.state.engine.failure
        assert "stopped" in error["message"] and why and why not in error["message"]  # why: the log's
        async with http.get(d.url + "/health", headers={"Authorization": "Bearer m-key"}) as r:
            body = await r.json()
            assert body["status"] == "failed" and why in body["error"]["message"]
        error = await expect(http, "POST", d.url + CHAT, 503, "not_ready", json=chat_body())
        assert why not in error["message"]


async def test_no_responses_input_yields_a_500(daemon, http):
    rng = random.Random(1)
    values = [None, True, -1, 0, 1.5, 10**30, "", "x", [], [1, "a"], {}, {"a": 1}, "\ud800", [[]], [{}],
              [{"type": "message"}], [{"role": "user", "content": [{"type": "input_text"}]}],
              [{"type": "function_call", "call_id": 1}], [{"type": "function_call_output", "call_id": "c"}],
              [{"type": "reasoning", "summary": "x"}], {"format": {"type": "json_schema"}}, {"format": 1},
              [{"type": "function"}], [{"type": "function", "name": 3}], {"type": "function"}, "resp_nope"]
    fields = ["input", "model", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature",
              "top_p", "text", "previous_response_id", "store", "stream", "parallel_tool_calls", "metadata"]
    good = {"input": "the capital of France", "max_output_tokens": 1, "temperature": 0}
    bodies: list[bytes] = [b"null", b"[]", b'"x"', b"{}", b"\xff\xfe\x00", b'{"input": 1}']
    for _ in range(200):
        body = dict(good)
        for field in rng.sample(fields, rng.randint(1, 3)):
            body[field] = rng.choice(values)
        bodies.append(json.dumps(body).encode())
    for data in bodies:
        async with http.post(daemon.url + "/v1/responses", data=data, headers={"Content-Type": "application/json"}) as r:
            text = await r.text()
            assert r.status < 500, (data[:200], text)
            if r.status >= 400:
                await error_of(r)
