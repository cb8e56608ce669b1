"""Hostile clients and tenants over HTTP (issue 22's findings), on a tiny real model: every one refused with a
clear 4xx before it costs the daemon work, bounded, or kept to its own tenant."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import aiohttp
import pytest

from http_daemon import chat_body, metrics, serving, until
from kvfork.server.api.responses.store import RESPONSES as RESPONSE_STORE

CHAT, COMPLETIONS, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
KEYS = "key-a tenant-a\nkey-b tenant-b\n"
PROMPT = "a long shared system prompt that every request here sends, word for word, " * 3


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=512)) as d:
        yield d


async def refused(http, url: str, body: dict, status: int = 400, headers: dict | None = None) -> dict:
    async with http.post(url, json=body, headers=headers or {}) as r:
        text = await r.text()
        assert r.status == status, text
    return json.loads(text)


async def raw_exchange(port: int, data: bytes, read_s: float = 30.0) -> bytes:
    """Send raw bytes, then read what comes back until the daemon closes the connection (bounded)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        async with asyncio.timeout(read_s):
            return await reader.read()
    except ConnectionResetError:  # closed with a reset (slow_clients.reset): nothing more to read
        return b""
    finally:
        writer.close()


# ---- 1: a client's chat template ----


async def test_a_client_cannot_set_the_template_or_the_call(daemon, http):
    url = daemon.url + CHAT
    loop = {"chat_template": "{% for i in range(2000) %}x{% endfor %}{{ messages[0]['content'] }}"}
    for kwargs, key in [(loop, "chat_template"), ({"tokenize": True}, "tokenize"), ({"return_dict": True}, "return_dict"),
                        ({"continue_final_message": True}, "continue_final_message"), ({"bos_token": "x"}, "bos_token")]:
        error = (await refused(http, url, chat_body("hi", max_tokens=1, chat_template_kwargs=kwargs)))["error"]
        assert error["param"] == f"chat_template_kwargs.{key}" and "--chat-template" in error["message"]
    # a key the template never reads is dropped, as vLLM does: the prompt is the same as without it
    async with http.post(url, json=chat_body("hi", max_tokens=1, chat_template_kwargs={"enable_thinking": False})) as r:
        assert r.status == 200
        with_kwarg = (await r.json())["usage"]["prompt_tokens"]
    async with http.post(url, json=chat_body("hi", max_tokens=1)) as r:
        assert (await r.json())["usage"]["prompt_tokens"] == with_kwarg


async def test_the_operators_template_and_its_own_variables(tiny_model_dir, tmp_path, http):
    template = tmp_path / "chat.jinja"
    template.write_text("{% if enable_thinking %}THINK {% endif %}{{ strftime_now('%Y') if stamp else '' }}"
                        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    async with serving(tiny_model_dir("llama"), chat_template=str(template)) as d:
        url = d.url + CHAT

        async def prompt_tokens(**kwargs) -> int:
            async with http.post(url, json=chat_body("hi", max_tokens=1, chat_template_kwargs=kwargs)) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["usage"]["prompt_tokens"]

        assert await prompt_tokens(enable_thinking=True) > await prompt_tokens(enable_thinking=False)
        for kwargs, param in [({"strftime_now": "x"}, "strftime_now"), ({"enable_thinking": [1]}, "enable_thinking"),
                              ({"stamp": "x" * 1025}, "stamp")]:
            error = (await refused(http, url, chat_body("hi", max_tokens=1, chat_template_kwargs=kwargs)))["error"]
            assert error["param"] == f"chat_template_kwargs.{param}"


# ---- 3 and the other counts: per route, at the route's API's limit ----


async def test_stop_strings_are_capped_per_route(daemon, http):
    error = (await refused(http, daemon.url + CHAT, chat_body("hi", stop=["a", "b", "c", "d", "e"])))["error"]
    assert (error["param"], error["code"]) == ("stop", "array_above_max_length") and "--max-stop" in error["message"]
    await refused(http, daemon.url + COMPLETIONS, {"prompt": "hi", "stop": ["x" * 257]})
    messages = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(daemon.url + MESSAGES, json={**messages, "stop_sequences": [f"s{i}" for i in range(40)]}) as r:
        assert r.status == 200  # Anthropic's route takes far more than OpenAI's four
    body = await refused(http, daemon.url + MESSAGES, {**messages, "stop_sequences": [f"s{i}" for i in range(257)]})
    assert body["type"] == "error" and "--max-stop-sequences" in body["error"]["message"]  # Anthropic's shape


async def test_logit_bias_tools_and_n_are_capped(daemon, http):
    bias = {str(i): 1 for i in range(301)}
    assert (await refused(http, daemon.url + CHAT, chat_body(logit_bias=bias)))["error"]["param"] == "logit_bias"
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(129)]
    assert (await refused(http, daemon.url + CHAT, chat_body(tools=tools)))["error"]["param"] == "tools"
    assert (await refused(http, daemon.url + RESPONSES, {"input": "hi", "tools": [
        {"type": "function", "name": f"f{i}", "parameters": {}} for i in range(129)]}))["error"]["param"] == "tools"


# ---- 6: an oversized prompt is refused before it is tokenized ----


async def test_an_oversized_prompt_is_refused_before_tokenizing(daemon, http):
    tokenizer = daemon.state.tokenizer
    encoded: list[int] = []
    real = tokenizer.encode_rendered_text

    def counting(text: str, tok=None) -> list[int]:
        encoded.append(len(text))
        return real(text, tok)

    tokenizer.encode_rendered_text = counting
    huge = "word " * (32 * 512 // 5 + 100)  # past 32 x the context of 512
    error = (await refused(http, daemon.url + CHAT, chat_body(huge)))["error"]
    assert (error["code"], error["param"]) == ("limit_exceeded", "messages") and "--max-prompt-chars" in error["message"]
    error = (await refused(http, daemon.url + COMPLETIONS, {"prompt": huge}))["error"]
    assert error["param"] == "prompt"
    assert encoded == []
    # a prompt just over the context still reaches the token count and its context-length wording
    error = (await refused(http, daemon.url + CHAT, chat_body("word " * 700)))["error"]
    assert error["code"] == "context_length_exceeded"


async def test_a_long_prompt_over_the_context_is_refused_on_its_prefix(daemon, http):
    """A prompt of many characters a token, under --max-prompt-chars but over the context, is refused once its
    first 8 characters a context token pass the context: the tokenizer never gets it whole (issue 45's soak,
    the `prompt` shape). Each API says so in its own words, with the tokens counted."""
    from kvfork.server.text.tokenizer import PREFIX_CHARS_PER_TOKEN

    tokenizer = daemon.state.tokenizer
    encoded: list[int] = []
    real_rendered, real_text = tokenizer.encode_rendered_text, tokenizer.encode_text

    def counting(real):
        return lambda text, tok=None: encoded.append(len(text)) or real(text, tok)

    tokenizer.encode_rendered_text, tokenizer.encode_text = counting(real_rendered), counting(real_text)
    try:
        long = "ab " * (30 * 512 // 3)  # 30 characters a token of the context of 512: under the cap of 32
        error = (await refused(http, daemon.url + CHAT, chat_body(long)))["error"]
        assert error["code"] == "context_length_exceeded"
        counted = int(re.fullmatch(r"the prompt has at least (\d+) tokens; the context holds 512, prompt and "
                                   r"output together", error["message"]).group(1))
        assert counted >= 512
        error = (await refused(http, daemon.url + COMPLETIONS, {"prompt": long}))["error"]
        assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
        body = {"max_tokens": 4, "messages": [{"role": "user", "content": long}]}
        error = (await refused(http, daemon.url + MESSAGES, body))["error"]
        assert re.fullmatch(r"prompt is too long: \d+ tokens > 511 maximum", error["message"])
    finally:
        tokenizer.encode_rendered_text, tokenizer.encode_text = real_rendered, real_text
    assert encoded and max(encoded) <= PREFIX_CHARS_PER_TOKEN * 512 < len(long)


# ---- 4: stored responses and named sessions, per tenant ----


async def test_stored_responses_and_sessions_are_counted_per_tenant(tiny_model_dir, keys_file, http):
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file, max_stored_responses=3,
                       engine=dict(max_named_sessions=2)) as d:
        async def store(key: str, text: str = "hello") -> str:
            async with http.post(d.url + RESPONSES, json={"input": text, "max_output_tokens": 2},
                                 headers=auth(key)) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["id"]

        mine = await store("key-a")
        for _ in range(3):
            await store("key-b")
        async with http.get(f"{d.url}{RESPONSES}/{mine}", headers=auth("key-a")) as r:
            assert r.status == 200  # b's three took b's own room, not a's
        for _ in range(3):
            await store("key-a")
        async with http.get(f"{d.url}{RESPONSES}/{mine}", headers=auth("key-a")) as r:
            assert r.status == 404  # a's own fourth pushed a's oldest out

        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        async with http.post(d.url + CHAT, json={**body, "session_id": "a1"}, headers=auth("key-a")) as r:
            assert r.status == 200
        for name in ("b1", "b2", "b3"):
            async with http.post(d.url + CHAT, json={**body, "session_id": name}, headers=auth("key-b")) as r:
                assert r.status == 200
        async with http.post(d.url + "/v1/sessions/a1/reset", headers=auth("key-a")) as r:
            assert r.status == 200  # still there: b's sessions evicted b's own
        async with http.post(d.url + "/v1/sessions/b1/reset", headers=auth("key-b")) as r:
            assert r.status == 404


async def test_stored_response_bytes_have_a_quota(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), max_stored_response_bytes=16 * 1024) as d:
        async def store(text: str) -> aiohttp.ClientResponse:
            return await http.post(d.url + RESPONSES, json={"input": text, "max_output_tokens": 1})

        first = await (await store("x " * 2000)).json()  # about 4 KB each
        for _ in range(4):
            assert (await store("y " * 2000)).status == 200
        async with http.get(f"{d.url}{RESPONSES}/{first['id']}") as r:
            assert r.status == 404  # past 16 KiB the oldest went
        assert d.app[RESPONSE_STORE].use("").nbytes <= 16 * 1024
        r = await store("z " * 9000)  # alone over the quota: refused before it runs
        assert r.status == 400 and "--max-stored-response-bytes" in (await r.json())["error"]["message"]


# ---- 9: bad input is never a 500 ----


async def test_nested_bodies_and_schemas_are_400s(daemon, http):
    deep = json.dumps(chat_body("hi")).encode()[:-1] + b', "metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    async with http.post(daemon.url + CHAT, data=deep, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400 and "--max-json-depth" in (await r.json())["error"]["message"]
    schema: dict = {"type": "string"}
    for _ in range(500):
        schema = {"type": "array", "items": schema}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    await refused(http, daemon.url + CHAT, chat_body("hi", response_format=fmt))
    args = "[" * 5000 + "]" * 5000  # nesting inside a string: the template gets it as text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    async with http.post(daemon.url + CHAT, json={"messages": messages, "max_tokens": 1}) as r:
        assert r.status in (200, 400)
    m = await metrics(http, daemon.url)
    assert not [k for k in m if 'status="500"' in k]


async def test_keys_are_read_as_rfc_7235_says_and_bad_bytes_are_a_401(tiny_model_dir, keys_file, http):
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file) as d:
        body = chat_body("hi", max_tokens=1)
        async with http.post(d.url + CHAT, json=body, headers={"Authorization": "bearer key-a"}) as r:
            assert r.status == 200
        async with http.post(d.url + CHAT, json=body, headers={"Authorization": "BEARER  key-a "}) as r:
            assert r.status == 200
        for header in (b"Authorization: Bearer \xff\xfe", b"x-api-key: \xff\xfekey-a"):
            reply = await raw_exchange(d.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n" + header +
                                       b"\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                                       b"Connection: close\r\n\r\n{}")
            assert reply.startswith(b"HTTP/1.1 401"), reply[:200]


# ---- 10: --api-key tenants are their own ----


async def test_an_api_key_never_shares_a_keys_file_tenant_of_its_name(tiny_model_dir, tmp_path, http, caplog):
    keys = tmp_path / "keys"
    keys.write_text("key-bravo-2222 bravo\n")
    async with serving(tiny_model_dir("llama"), api_key=["bravo"], api_keys_file=str(keys)) as d:
        body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 2}
        async with http.post(d.url + CHAT, json=body, headers=auth("key-bravo-2222")) as r:
            assert r.status == 200
        with caplog.at_level("INFO", logger="kvfork"):
            async with http.post(d.url + CHAT, json=body, headers=auth("bravo")) as r:
                assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    import hashlib

    line = next(rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request "))
    assert hashlib.sha256(b"bravo").hexdigest()[:12] not in line  # the log names no hash of the key


# ---- 12: slow clients ----

SLOW = dict(header_timeout=1.0, body_timeout=1.0, write_timeout=1.0)


async def test_a_partial_head_or_a_trickled_body_is_cut_off_and_counted(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), **SLOW) as d:
        partial = await raw_exchange(d.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
        assert partial == b""  # closed without a word
        trickled = await raw_exchange(d.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                                              b"Content-Type: application/json\r\nContent-Length: 16000000\r\n\r\n{")
        assert b" 200 " not in trickled
        idle = await raw_exchange(d.port, b"")  # an idle connection is closed too, uncounted
        assert idle == b""
        m = await metrics(http, d.url)
        assert m['kvfork_http_read_timeouts_total{phase="header"}'] == 1
        assert m['kvfork_http_read_timeouts_total{phase="body"}'] == 1


async def test_an_unauthenticated_huge_body_does_not_hold_its_connection(tiny_model_dir, keys_file):
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file, **SLOW) as d:
        reply = await raw_exchange(d.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                                           b"Content-Length: 16000000\r\n\r\n{", read_s=20)
        assert reply.startswith(b"HTTP/1.1 401")  # and then closed: raw_exchange read to the end


async def test_a_stream_nobody_reads_is_cancelled_and_closed(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), **SLOW) as d:
        body = json.dumps(chat_body("tell me everything", n=4, logprobs=True, top_logprobs=20, max_tokens=2000,
                                    ignore_eos=True, stream=True)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", d.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        try:  # and never read
            await until(lambda: metrics(http, d.url), lambda m: m.get("kvfork_http_write_timeouts_total", 0) == 1,
                        "the stalled stream cut off")
            await until(lambda: metrics(http, d.url), lambda m: m.get("kvfork_running_requests", 1) == 0,
                        "its choices cancelled")
        finally:
            sock.close()


async def test_metrics_can_require_a_key_of_its_own(tiny_model_dir, keys_file, http):
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file, metrics_key="scrape-me") as d:
        async with http.get(d.url + "/metrics") as r:
            assert r.status == 401
        async with http.get(d.url + "/metrics", headers=auth("key-a")) as r:
            assert r.status == 401  # a tenant's key does not open every tenant's counts
        async with http.get(d.url + "/metrics", headers=auth("scrape-me")) as r:
            assert r.status == 200 and "kvfork_http_read_timeouts_total" in await r.text()
        async with http.get(d.url + "/health") as r:
            assert r.status == 200
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file) as d:
        async with http.get(d.url + "/metrics") as r:
            assert r.status == 200  # open by default


# ---- issue 45: work on the loop ----


async def test_messages_content_blocks_are_counted_before_they_are_translated(tiny_model_dir, http, monkeypatch):
    """A Messages body's content blocks (a tool result's own, the system's) count with its messages against
    --max-messages, before any is translated: one message of many blocks is a 400 as many messages are."""
    from kvfork.server.api.messages import route

    translated = []
    monkeypatch.setattr(route, "chat_request", lambda body: translated.append(body) or {})
    text = {"type": "text", "text": "hi"}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [text] * 6}
    bodies = [[{"role": "user", "content": [text] * 9}],
              [{"role": "user", "content": [result]}, {"role": "user", "content": [text]}]]
    async with serving(tiny_model_dir("llama"), max_messages=8) as d:
        for messages in bodies:
            for path in (MESSAGES, MESSAGES + "/count_tokens"):
                body = {"max_tokens": 2, "messages": messages, "system": [text]}
                error = (await refused(http, d.url + path, body))["error"]
                assert "--max-messages" in error["message"] and "content blocks" in error["message"]
    assert not translated


async def test_the_template_probe_at_load_is_bounded(tiny_model_dir, tmp_path, http):
    """The load's probe (does the template render tools?) renders as a request does, on a worker within
    --template-timeout: a template that loops when given tools still loads, and serves messages without."""
    template = tmp_path / "loop.jinja"
    template.write_text("{% if tools %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                        "{% endfor %}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    async with serving(tiny_model_dir("llama"), chat_template=str(template), template_timeout=0.5) as d:
        async with http.post(d.url + CHAT, json=chat_body("hi", max_tokens=1)) as r:
            assert r.status == 200, await r.text()
