"""A real headless browser for page tests: Debian's `chromium`, driven through the DevTools protocol
(aiohttp's websocket client: no driver to download). The test set-up installs chromium with apt when
it is missing and the tests run as root; otherwise the page tests skip, saying why."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import pytest

from debian_packages import installed

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--remote-debugging-port=0", "--window-size=1100,1300")


def chromium() -> str:
    """chromium's path: installed with apt first when missing and running as root; else the test skips."""
    if not installed(["chromium"], ["chromium"]):
        pytest.skip("Debian's chromium is not installed (`apt-get install -y chromium`), and the tests do not "
                    "run as root to install it")
    return shutil.which("chromium")


class Page:
    """One browser tab, spoken to over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws, self.ids = ws, itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict:
        ask = next(self.ids)
        await self.ws.send_json({"id": ask, "method": method, "params": params})
        async for message in self.ws:
            reply = json.loads(message.data)
            if reply.get("id") == ask:
                assert "error" not in reply, reply
                return reply["result"]
        raise ConnectionError("the browser went away")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> bytes:
        data = base64.b64decode((await self.call("Page.captureScreenshot", format="png"))["data"])
        path.write_bytes(data)
        return data


@asynccontextmanager
async def browser(url: str, profile: Path) -> AsyncIterator[Page]:
    """A fresh chromium (its own profile folder) showing `url`."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # the tests' BLAS is not chromium's
    process = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={profile}", "about:blank"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        active = profile / "DevToolsActivePort"
        for _ in range(600):
            if active.exists() and active.read_text().strip():
                break
            await asyncio.sleep(0.05)
        port = active.read_text().split()[0]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                tab = next(t for t in await r.json() if t["type"] == "page")
            async with http.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                page = Page(ws)
                await page.call("Page.enable")
                await page.call("Page.navigate", url=url)
                yield page
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
