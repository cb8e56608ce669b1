"""KV events checked by a real consumer: vllm-router's kv_aware policy over two daemons publishing them routes a
repeated prompt to the replica that holds it, where its round_robin alternates. vllm-router routes on token ids
(it renders chat only for workers it knows the model files of), so the prompts are token ids on
/v1/completions. Skips when vllm-router is not installed (pip install '.[kv-router]', Linux)."""

from __future__ import annotations

import asyncio
import random
import shutil
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import pytest

from http_daemon import serving
from kvfork.tools.bench.serve import free_port

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
pytestmark = pytest.mark.skipif(not Path(ROUTER).exists(), reason="vllm-router is not installed: "
                                "pip install '.[kv-router]'")
pytest.importorskip("zmq")
START_S = 120.0


async def start_router(policy: str, daemons, block_size: int) -> tuple[asyncio.subprocess.Process, str]:
    port = free_port()
    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
            "--policy", policy, "--worker-startup-check-interval", "1",
            "--worker-urls", *(d.url for d in daemons)]
    if policy == "kv_aware":
        for d in daemons:
            pub = d.kv_events.publisher
            argv += ["--kv-event-source", f"{d.url}={pub.endpoint}",
                     "--kv-event-replay-source", f"{d.url}={pub.replay_endpoint}"]
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", "tiny"]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL, env={"HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_S
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return proc, url
            except aiohttp.ClientError:
                pass
            assert proc.returncode is None and loop.time() < deadline, "vllm-router never became ready"
            await asyncio.sleep(0.5)


async def served(http: aiohttp.ClientSession, daemons) -> list[float]:
    out = []
    for d in daemons:
        async with http.get(d.url + "/metrics") as r:
            text = await r.text()
        out.append(sum(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("kvfork_requests_total")))
    return out


async def complete(http: aiohttp.ClientSession, url: str, ids: list[int]) -> int:
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def where_repeats_go(router: str, daemons, seed: str) -> list[tuple[int, list[int]]]:
    """Each prompt warmed on one replica directly, then sent twice through the router: (holder, servers)."""
    rng, out = random.Random(seed), []
    async with aiohttp.ClientSession() as http:
        for k in range(4):
            ids = [rng.randrange(10, 500) for _ in range(130)]
            holder = k % 2
            await complete(http, daemons[holder].url, ids)
            await asyncio.sleep(0.5)  # its BlockStored reaches the router
            servers = []
            for _ in range(2):
                before = await served(http, daemons)
                await complete(http, router, ids)
                after = await served(http, daemons)
                servers.append(next(i for i in range(2) if after[i] > before[i]))
            out.append((holder, servers))
    return out


async def test_kv_aware_routes_a_repeat_to_the_replica_holding_it(tiny_model_dir):
    async with AsyncExitStack() as stack:
        daemons = [await stack.enter_async_context(serving(
            tiny_model_dir("llama"), served_model_name=["tiny"], kv_events_endpoint="tcp://127.0.0.1:0",
            kv_events_replay_endpoint="tcp://127.0.0.1:0", kv_events_block_size=16)) for _ in range(2)]
        routers = []
        try:
            kv, kv_url = await start_router("kv_aware", daemons, 16)
            routers.append(kv)
            rr, rr_url = await start_router("round_robin", daemons, 16)
            routers.append(rr)
            aware = await where_repeats_go(kv_url, daemons, "kv")
            assert all(servers == [holder, holder] for holder, servers in aware), aware
            blind = await where_repeats_go(rr_url, daemons, "rr")
            assert all(servers[0] != servers[1] for _, servers in blind), blind  # it alternates, holder or not
        finally:
            for proc in routers:
                proc.terminate()
                await proc.wait()
