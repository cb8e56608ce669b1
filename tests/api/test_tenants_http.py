"""Tenants over HTTP: keys (--api-key, --api-keys-file), cache_salt, and what a tenant can see of another's
work (nothing: cached_tokens 0, another's session or stored response is unknown), on a tiny real model."""

from __future__ import annotations

import hashlib
import logging

import pytest

from http_daemon import serving
from kvfork.server.guard.tenants import KeyTable, key_tenants, read_keys_file

CHAT = "/v1/chat/completions"
PROMPT = "a long shared system prompt that every request here sends, word for word, " * 3
KEYS = "# team keys\nkey-a1 tenant-a\n\nkey-a2 tenant-a\nkey-b tenant-b\n"  # a1, a2: one tenant (a rotation)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def daemon(tiny_model_dir, keys_file):
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file) as d:
        yield d


async def cached(http, daemon, key: str, **extra) -> int:
    body = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 2, **extra}
    async with http.post(daemon.url + CHAT, json=body, headers=auth(key)) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_prompt_is_warm_only_within_its_tenant_and_salt(daemon, http):
    assert await cached(http, daemon, "key-a1") == 0
    assert await cached(http, daemon, "key-b") == 0  # tenant a's exact prompt, under b's key: cold
    assert await cached(http, daemon, "key-a1", cache_salt="x") == 0  # a's own prompt under another salt: cold
    assert await cached(http, daemon, "key-a2") > 0  # another key of tenant a: its tenant's cache
    assert await cached(http, daemon, "key-b") > 0  # b's own entry now
    assert await cached(http, daemon, "key-a1", cache_salt="x") > 0


@pytest.mark.parametrize("salt", ["", "s" * 257, 7])
@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/messages", "/v1/responses"])
async def test_a_bad_cache_salt_is_a_400_naming_it(daemon, http, path, salt):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt": "hi", "input": "hi",
            "cache_salt": salt}
    async with http.post(daemon.url + path, json=body, headers=auth("key-a1")) as r:
        assert r.status == 400
        text = await r.text()
    assert "cache_salt" in text


async def test_another_tenants_response_and_session_are_unknown(daemon, http):
    first = {"input": "hello", "max_output_tokens": 2}
    async with http.post(daemon.url + "/v1/responses", json=first, headers=auth("key-a1")) as r:
        rid = (await r.json())["id"]
    follow = {"input": "more", "max_output_tokens": 2, "previous_response_id": rid}
    async with http.post(daemon.url + "/v1/responses", json=follow, headers=auth("key-b")) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "previous_response_not_found"
    for method in ("GET", "DELETE"):
        async with http.request(method, f"{daemon.url}/v1/responses/{rid}", headers=auth("key-b")) as r:
            assert r.status == 404
    async with http.get(f"{daemon.url}/v1/responses/{rid}", headers=auth("key-a2")) as r:
        assert r.status == 200  # still there, for its own tenant
    async with http.post(daemon.url + "/v1/responses", json=follow, headers=auth("key-a1")) as r:
        assert r.status == 200

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "session_id": "s1"}
    async with http.post(daemon.url + CHAT, json=body, headers=auth("key-a1")) as r:
        assert r.status == 200
    async with http.post(daemon.url + "/v1/sessions/s1/reset", headers=auth("key-b")) as r:
        assert r.status == 404
    async with http.delete(daemon.url + "/v1/sessions/s1", headers=auth("key-b")) as r:
        assert r.status == 404
    async with http.post(daemon.url + "/v1/sessions/s1/reset", headers=auth("key-a2")) as r:
        assert r.status == 200


async def test_metrics_name_no_tenant_and_the_log_line_only_its_hash(daemon, http, caplog):
    with caplog.at_level(logging.INFO, logger="kvfork"):
        await cached(http, daemon, "key-b", cache_salt="pepper")
    async with http.get(daemon.url + "/metrics") as r:
        metrics = await r.text()
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("request ")]
    assert len(lines) == 1
    assert f'"tenant":"{hashlib.sha256(b"tenant-b").hexdigest()[:12]}"' in lines[0]
    for secret in ("key-", "tenant-", "pepper"):
        assert secret not in metrics and secret not in lines[0]


async def test_without_keys_every_request_shares_one_scope(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama")) as d:
        assert await cached(http, d, "anything") == 0
        assert await cached(http, d, "something else") > 0  # no keys: the key is not checked, one tenant


def test_the_keys_file(tmp_path, keys_file):
    assert read_keys_file(keys_file) == {"key-a1": "tenant-a", "key-a2": "tenant-a", "key-b": "tenant-b"}
    keys = KeyTable(key_tenants(["solo"], keys_file))
    assert keys.tenant("solo") == "key-1 (--api-key)" and keys.tenant("key-a2") == "tenant-a"
    assert keys.tenant("") is None and keys.tenant("key-a") is None and keys.tenant("\udcff") is None
    assert key_tenants([], None) == {}
    # three fields, one field, no keys at all, a key given to two tenants
    for text in ("k t extra\n", "k\n", "# nothing\n\n", "k a\nk b\n"):
        path = tmp_path / "bad"
        path.write_text(text)
        with pytest.raises(ValueError, match="bad"):
            read_keys_file(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_keys_file(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--api-key"):
        key_tenants(["key-b"], keys_file)  # a --api-key key the file gives to a named tenant


def test_a_key_is_found_in_constant_work_among_100000(monkeypatch):
    """O(1): one SHA-256 of the presented key and one compare_digest, whatever the number of keys (counted, not
    timed)."""
    import hmac

    from kvfork.server.guard import tenants

    keys = KeyTable({f"key-{i}": f"tenant-{i % 7}" for i in range(100_000)})
    compares: list[int] = []
    real = hmac.compare_digest
    monkeypatch.setattr(tenants.hmac, "compare_digest", lambda a, b: compares.append(1) or real(a, b))
    assert keys.tenant("key-99999") == "tenant-4" and keys.tenant("key-100000") is None
    assert keys.tenant("key-5") == "tenant-5"
    assert len(compares) == 3 and len(keys) == 100_000
