"""The reuse page's JSON (GET /debug/reuse) and GET /: what a burst with clones shows, who may read it,
and that no tenant sees another's requests, entries or sessions; no prompt text anywhere."""

from __future__ import annotations

import aiohttp

from agent_server import agent_model  # noqa: F401 (fixture)
from http_daemon import serving, until
from kvfork.server.engine.policy.entries import Entry
from kvfork.server.watch.reuse import prefix_tree

SYSTEM = "You are a coding agent in a shared repository; the words of this prompt are secret. " * 4


def chat(user: str, **extra) -> dict:
    return {"model": "tiny", "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], **extra}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def reuse(http, url, headers) -> dict:
    async with http.get(url + "/debug/reuse", headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def test_the_tree_joins_entries_at_the_prefixes_they_share():
    entries = [Entry("memory", "s1", (1, 2, 3, 4)), Entry("memory", "s1", (1, 2, 3, 9, 9)),
               Entry("disk", "s1", (1, 2)), Entry("memory", "s2", (7, 7))]
    tree = prefix_tree(entries)
    assert [root["scope"] for root in tree] == ["s1", "s2"]
    root = tree[0]  # (1, 2) is an entry, and the two others part after (1, 2, 3)
    assert root["tokens"] == 2 and [e["tier"] for e in root["entries"]] == ["disk"]
    [fork] = root["children"]
    assert fork["tokens"] == 3 and fork["entries"] == []
    assert sorted(c["tokens"] for c in fork["children"]) == [4, 5]


async def test_a_burst_with_a_clone_shows_live_requests_decisions_and_the_cache(agent_model):
    # the burst's prompts are under the cache's minimum: the second can only clone the first, running;
    # a longer prompt after it is kept in the cache
    # the donor decodes without drafts, so it is still running when the others arrive
    engine = dict(active_prefix_reuse_min_tokens=1, prefix_cache_min_tokens=200, speculative="off")
    async with serving(agent_model, served_model_name=["tiny"], engine=engine) as daemon, \
            aiohttp.ClientSession() as http:
        async with http.post(daemon.url + "/v1/chat/completions",
                             json=chat("go on", max_tokens=3000, ignore_eos=True, stream=True)) as donor:
            await donor.content.readline()  # it is running
            during = await until(lambda: reuse(http, daemon.url, {}),
                                 lambda d: any(r["committed"] > 100 for r in d["live"]), "the donor committed")
            async with http.post(daemon.url + "/v1/chat/completions", json=chat("go on now")) as r:
                assert r.status == 200
            donor.close()  # the client goes away: the donor is cancelled
        await until(lambda: reuse(http, daemon.url, {}), lambda d: not d["live"], "the donor gone")
        async with http.post(daemon.url + "/v1/chat/completions", json=chat("a long one " * 60)) as r:
            assert r.status == 200
        seen = await reuse(http, daemon.url, {})
        async with http.get(daemon.url + "/", headers={"Accept": "text/html"}) as page:
            html = await page.text()
        async with http.head(daemon.url + "/") as probe:
            assert probe.status == 200
        async with http.get(daemon.url + "/") as plain:
            assert await plain.text() == "kvfork\n"
    [running] = during["live"]
    assert running["phase"] == "decoding" and running["request_id"].startswith("chatcmpl-")
    assert running["prompt_tokens"] == running["committed"] and running["age_s"] >= 0
    clone = next(d for d in seen["decisions"] if d["source"] == "donor")
    assert clone["donor"] == running["request_id"]
    assert clone["reason"] == "cloned a running request" and clone["saved_tokens"] > 100 and clone["donor"]
    assert sum(b["reused_tokens"] for b in seen["series"]) >= clone["saved_tokens"]
    assert seen["cache"]["entries"] >= 1 and seen["cache"]["tree"][0]["tokens"] > 0
    assert "secret" not in str(seen) and "<script>" in html and "/debug/reuse" in html


async def test_a_keyed_caller_sees_only_its_own_tenant(agent_model):
    async with serving(agent_model, served_model_name=["tiny"], api_key=["key-a", "key-b"],
                       metrics_key="ops-key") as daemon, aiohttp.ClientSession() as http:
        for key, user in (("key-a", "first"), ("key-b", "second")):
            async with http.post(daemon.url + "/v1/chat/completions", json=chat(user, session_id=f"s-{key}"),
                                 headers=bearer(key)) as r:
                assert r.status == 200
                mine = (await r.json())["id"]
            view = await reuse(http, daemon.url, bearer(key))
            assert [d["request_id"] for d in view["decisions"]] == [mine]
            assert [s["name"] for s in view["sessions"]] == [f"s-{key}"]
        ops = await reuse(http, daemon.url, bearer("ops-key"))
        assert len(ops["decisions"]) == 2 and len(ops["sessions"]) == 2
        only_a = await reuse(http, daemon.url, bearer("key-a"))
        assert only_a["cache"]["entries"] == 1 and len(ops["cache"]["tree"]) == 2
        for headers in ({}, bearer("wrong")):
            async with http.get(daemon.url + "/debug/reuse", headers=headers) as r:
                assert r.status == 401
        async with http.get(daemon.url + "/", headers={"Accept": "text/html"}) as r:
            assert r.status == 200  # the page holds no data: it asks for a key
