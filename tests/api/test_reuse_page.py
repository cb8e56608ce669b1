"""The reuse page at `/` in a real headless browser (tests/headless.py): it loads from the daemon alone,
reads /debug/reuse from its own origin, and shows a burst with a clone as it happens: the running
request, the clone's decision and whom it cloned, the cache, the hit rate and its chart.

With KVFORK_PAGE_SCREENSHOT=PATH the run's screenshot is written there too (docs/reuse-page.png
comes from such a run)."""

from __future__ import annotations

import os
from pathlib import Path

import aiohttp

from agent_server import agent_model  # noqa: F401 (fixture)
from headless import browser
from http_daemon import serving, until

SYSTEM = "You are a coding agent in a shared repository; the words of this prompt are secret. " * 4
SHOWN = """(() => {
  const rows = (id) => [...document.querySelectorAll('#' + id + ' tbody tr')].map(
      (tr) => [...tr.children].map((td) => td.textContent));
  return {status: document.getElementById('status').textContent, live: rows('live'),
          decisions: rows('decisions'), sessions: rows('sessions'),
          hit: document.getElementById('hit-rate').textContent,
          tree: document.getElementById('tree').textContent,
          bars: document.querySelectorAll('#chart rect').length, text: document.body.innerText};
})()"""


def chat(user: str, **extra) -> dict:
    return {"model": "tiny", "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}], **extra}


async def test_the_page_shows_a_burst_with_a_clone_live(agent_model, tmp_path):
    # the burst's prompts are under the cache's minimum, so the second clones the first while it runs;
    # the longer prompts after it are kept in the cache
    # the donor decodes one token a step (drafts would let the tiny model's repetitive reply end in a blink)
    engine = dict(active_prefix_reuse_min_tokens=1, prefix_cache_min_tokens=200, speculative="off")
    async with serving(agent_model, served_model_name=["tiny"], engine=engine) as daemon, \
            aiohttp.ClientSession() as http, browser(daemon.url + "/", tmp_path / "profile") as page:
        async with http.post(daemon.url + "/v1/chat/completions",
                             json=chat("go on", max_tokens=3000, ignore_eos=True, stream=True)) as donor:
            await donor.content.readline()
            for user in ("go on now", "a long one " * 60, "a long one " * 60 + "again",
                         "a long one " * 60 + "and again"):
                extra = {"session_id": "agent-7"} if "and again" in user else {}
                async with http.post(daemon.url + "/v1/chat/completions", json=chat(user, **extra)) as r:
                    assert r.status == 200
            shown = await until(lambda: page.evaluate(SHOWN), lambda s: (
                any(row[1] == "decoding" for row in s["live"]) and len(s["decisions"]) >= 4
                and "tokens" in s["tree"] and s["sessions"] and s["bars"] > 0), "the page showing the burst")
            picture = await page.screenshot(tmp_path / "reuse-page.png")
            if os.environ.get("KVFORK_PAGE_SCREENSHOT"):
                Path(os.environ["KVFORK_PAGE_SCREENSHOT"]).write_bytes(picture)
            donor.close()
    assert shown["status"].startswith("live: updated")
    clones = [row for row in shown["decisions"] if row[6] == "cloned a running request"]
    assert clones and clones[-1][7].startswith("chatcmpl-") and int(clones[-1][4]) > 100
    assert any(row[6] == "prefix cache" for row in shown["decisions"])
    assert shown["sessions"][0][0] == "agent-7"
    assert shown["hit"].endswith("%") and float(shown["hit"][:-1]) > 0
    assert "secret" not in shown["text"]  # token counts and ids only, never the prompt
    assert picture.startswith(b"\x89PNG")
