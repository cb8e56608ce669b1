"""Browsers (issue 33, finding 17): another site's page cannot drive a keyless daemon or read its replies
(CSRF, DNS rebinding); an origin the operator allows gets CORS; real clients are unchanged."""

from __future__ import annotations

import json

import pytest

from http_daemon import chat_body, serving

CHAT = "/v1/chat/completions"


@pytest.fixture
async def daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=256)) as d:
        yield d


@pytest.fixture
async def cors_daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=256),
                       allowed_origins=["https://chat.example.com"], allowed_hosts=["kvfork.internal"]) as d:
        yield d


async def post(http, url: str, data: bytes | str, headers: dict) -> tuple[int, dict, dict]:
    async with http.post(url, data=data, headers=headers) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


async def test_a_cross_site_text_plain_post_runs_nothing(daemon, http):
    body = json.dumps(chat_body(max_tokens=2))
    port = daemon.port
    for headers, status, code in [
            # what a page of evil.example sends with fetch(..., {mode: "no-cors"}) or a form
            ({"Origin": "https://evil.example", "Content-Type": "text/plain"}, 403, "origin_not_allowed"),
            ({"Origin": "null", "Content-Type": "text/plain;charset=UTF-8"}, 403, "origin_not_allowed"),
            ({"Origin": f"http://localhost:{port + 1}", "Content-Type": "application/json"}, 403,
             "origin_not_allowed"),  # another local server's page is another site
            # a rebinding page: its own name in Host, its own origin
            ({"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}",
              "Content-Type": "application/json"}, 403, "host_not_allowed"),
            # same origin, but a body type no API client sends
            ({"Origin": f"http://127.0.0.1:{port}", "Content-Type": "text/plain"}, 415, "unsupported_media_type"),
            ({"Origin": f"http://127.0.0.1:{port}", "Content-Type": "application/x-www-form-urlencoded"}, 415,
             "unsupported_media_type"),
            ({"Content-Type": "multipart/form-data; boundary=x"}, 415, "unsupported_media_type")]:
        status_got, _, reply = await post(http, daemon.url + CHAT, body, headers)
        assert (status_got, reply["error"]["code"]) == (status, code), (headers, reply)
    # the Messages route answers in Anthropic's shape
    status, _, reply = await post(http, daemon.url + "/v1/messages", body,
                                  {"Origin": "https://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and reply["type"] == "error" and reply["error"]["type"] == "permission_error"


async def test_every_get_checks_the_host(daemon, http):
    for path in ("/metrics", "/health", "/v1/models", "/v1/loads", "/"):
        async with http.get(daemon.url + path, headers={"Host": "rebound.example"}) as r:
            assert r.status == 403, path
        async with http.get(daemon.url + path, headers={"Host": "localhost"}) as r:
            assert r.status == 200, path


async def test_real_clients_are_unchanged(daemon, http):
    port = daemon.port
    body = json.dumps(chat_body(max_tokens=1))
    for headers in [{"Content-Type": "application/json"},  # the SDKs: no Origin
                    {"Content-Type": "application/x-www-form-urlencoded"},  # curl -d without -H
                    {"Content-Type": ""},  # requests' data=: no type at all
                    {"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"},  # our own page
                    {"Content-Type": "application/json", "Host": f"localhost:{port}"},
                    {"Content-Type": "application/json", "Host": f"[::1]:{port}"}]:
        status, _, reply = await post(http, daemon.url + CHAT, body, headers)
        assert status == 200, (headers, reply)


async def test_an_allowed_origin_gets_cors_and_its_preflight(cors_daemon, http):
    url, origin = cors_daemon.url + CHAT, "https://chat.example.com"
    async with http.options(url, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization, content-type"}) as r:
        assert r.status == 204
        assert r.headers["Access-Control-Allow-Origin"] == origin
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
    async with http.options(url, headers={"Origin": "https://evil.example",
                                          "Access-Control-Request-Method": "POST"}) as r:
        assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
    status, headers, reply = await post(http, url, json.dumps(chat_body(max_tokens=1)),
                                        {"Origin": origin, "Content-Type": "application/json"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == origin, reply
    async with http.get(cors_daemon.url + "/health", headers={"Host": "kvfork.internal"}) as r:
        assert r.status == 200
