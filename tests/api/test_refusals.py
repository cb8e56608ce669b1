"""Refusals rate-limited (issue 33, finding 9): a tenant that floods bad requests is slowed to 429s after a pause,
and the others are not; the bucket itself, on a clock of the test's."""

from __future__ import annotations

import aiohttp

from http_daemon import chat_body, serving
from kvfork.server.guard.refusals import BURST_S, RefusalLimiter

KEYS = "key-hostile hostile\nkey-innocent innocent\n"


def test_the_bucket_fills_at_its_rate_and_holds_its_burst():
    now = [0.0]
    limiter = RefusalLimiter(2.0, clock=lambda: now[0])
    key = ("tenant", "t")
    for _ in range(int(2.0 * BURST_S)):
        assert not limiter.over(key)
        limiter.refused(key)
    assert limiter.over(key) and not limiter.over(("tenant", "other"))
    now[0] += 0.5  # one refusal's worth comes back
    assert not limiter.over(key)
    limiter.refused(key)
    assert limiter.over(key)
    now[0] += 3600  # never more than the burst
    for _ in range(int(2.0 * BURST_S)):
        limiter.refused(key)
    assert limiter.over(key)


async def test_a_flood_of_bad_requests_slows_its_tenant_alone(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    # one refusal per 100 s, in a burst of one: the second refusal's bucket is empty whatever the machine's speed
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=256), api_keys_file=str(keys),
                       refusal_rate=0.01) as d, aiohttp.ClientSession() as http:
        url = d.url + "/v1/chat/completions"
        hostile, innocent = {"Authorization": "Bearer key-hostile"}, {"Authorization": "Bearer key-innocent"}
        bad_template = chat_body(max_tokens=1, chat_template_kwargs={"tokenize": True})  # a fast 400
        assert [await _status(http, url, hostile, bad_template) for _ in range(3)] == [400, 429, 429]
        async with http.post(url, json=chat_body(max_tokens=1), headers=hostile) as r:
            assert r.status == 429 and (await r.json())["error"]["code"] == "rate_limit_exceeded"
        assert await _status(http, url, innocent) == 200  # the other tenant is not slowed
        # bad keys: counted by the address, slowing only the requests that fail authentication
        assert [await _status(http, url, {"Authorization": "Bearer nope"}) for _ in range(3)] == [401, 429, 429]
        assert await _status(http, url, innocent) == 200


async def _status(http, url: str, headers: dict, body: dict | None = None) -> int:
    async with http.post(url, json=body or chat_body(max_tokens=1), headers=headers) as r:
        return r.status


async def test_a_tenant_whose_grammar_timed_out_gets_a_429_with_retry_after(tiny_model_dir):
    """The grammar compiler's cooldown (issue 45) in the API's shape: a 429 naming the limit, and when to retry."""
    wide = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(6000)}}}}
    async with serving(tiny_model_dir("llama"), engine=dict(max_context=256), grammar_compile_timeout=0.3) as d, \
            aiohttp.ClientSession() as http:
        url = d.url + "/v1/chat/completions"
        assert await _status(http, url, {}, chat_body(max_tokens=1, response_format=wide)) == 400
        async with http.post(url, json=chat_body(max_tokens=1, response_format=wide)) as r:
            error = (await r.json())["error"]
            assert r.status == 429 and error["code"] == "rate_limit_exceeded" and error["param"] == "response_format"
            assert "--grammar-compile-timeout" in error["message"] and 1 <= int(r.headers["Retry-After"]) <= 3
