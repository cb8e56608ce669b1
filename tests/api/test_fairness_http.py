"""Fair slots over HTTP, on a tiny real model (issue 45): a tenant holding every inference slot with long
generations pauses its newest for another tenant's request, whose answer then comes while the hog's
generations still run; the hog's paused streams go on to the very text they have without any preemption
(greedy and seeded alike)."""

from __future__ import annotations

import asyncio
import json

from http_daemon import serving

CHAT = "/v1/chat/completions"
KEYS = "hog-key tenant-hog\ninnocent-key tenant-innocent\n"
SLOTS, HOG_TOKENS = 4, 96


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def hog_body(i: int) -> dict:
    sampling = {"temperature": 0.9, "seed": 100 + i} if i % 2 else {"temperature": 0}
    return {"messages": [{"role": "user", "content": f"hog request number {i}, say a lot"}], "stream": True,
            "max_tokens": HOG_TOKENS, "ignore_eos": True, **sampling}


async def stream_text(http, url: str, body: dict, key: str, first: asyncio.Event | None = None) -> str:
    """The whole streamed text; `first` is set once its first piece has come."""
    pieces = []
    async with http.post(url, json=body, headers=auth(key)) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[len("data: "):])["choices"][0]["delta"]
            if delta.get("content"):
                pieces.append(delta["content"])
                if first is not None:
                    first.set()
    return "".join(pieces)


async def test_the_innocent_is_answered_while_the_hog_holds_every_slot_and_the_hog_loses_nothing(
        tiny_model_dir, keys_file, http):
    async with serving(tiny_model_dir("llama"), api_keys_file=keys_file,
                       engine={"inference_slots": SLOTS, "prefix_cache_entries": 0}) as d:
        url = d.url + CHAT
        alone = await asyncio.gather(*(stream_text(http, url, hog_body(i), "hog-key") for i in range(SLOTS)))
        firsts = [asyncio.Event() for _ in range(SLOTS)]
        hog = [asyncio.create_task(stream_text(http, url, hog_body(i), "hog-key", firsts[i]))
               for i in range(SLOTS)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)  # every slot the hog's, decoding
        body = {"messages": [{"role": "user", "content": "a short question"}], "max_tokens": 4, "temperature": 0}
        async with http.post(url, json=body, headers=auth("innocent-key")) as r:
            assert r.status == 200, await r.text()
        # answered with the hog's generations still running: it did not wait for one of them to end
        assert not any(task.done() for task in hog)
        assert d.engine.metrics.preemptions.get() >= 1
        assert await asyncio.gather(*hog) == alone  # the paused stream went on to the same text
