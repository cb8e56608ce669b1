"""What a gateway in front of several replicas (smg) reads from one: the generic-worker contract, /v1/loads in
smg's WorkerLoadResponse shape, the gauges the Gateway API Inference Extension scrapes, and the routing key
smg adds, which names no session here. Real HTTP, tiny model; smg itself is in tests/cluster/test_cluster.py."""

from __future__ import annotations

import aiohttp
import pytest

from http_daemon import chat_body, first_token, metrics, serving, until
from kvfork.server.engine.loop.utilization import TokenRate
from kvfork.server.launch.app import build_app

CHAT = "/v1/chat/completions"
LOADS = "/v1/loads?include=core,disagg,queues,memory"  # what smg asks for
LONG_RUN = 3000  # tokens: far more than the test lets a request run
# The owners smg maps to an engine of its own, and then talks to in that engine's dialect (its detect_backend).
ENGINE_OWNERS = {"sglang", "vllm", "trtllm", "nvidia", "tokenspeed", "mlx"}
# What smg probes to tell an engine (vLLM's /version, SGLang's /server_info) and to read metadata from.
ENGINE_PROBES = ["/version", "/server_info", "/get_server_info", "/model_info", "/get_model_info"]
RANK_FIELDS = {"dp_rank", "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
               "max_total_num_tokens", "token_usage", "gen_throughput", "cache_hit_rate", "utilization",
               "max_running_requests"}


async def test_a_gateway_classifies_kvfork_as_a_generic_worker(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), load=False) as d:
        async with http.get(d.url + "/health") as r:
            assert r.status == 503  # loading: not ready to route to
        await d.load()
        async with http.get(d.url + "/health") as r:
            assert r.status == 200
        async with http.get(d.url + "/v1/models") as r:
            owners = {card["owned_by"] for card in (await r.json())["data"]}
        assert owners and not owners & ENGINE_OWNERS, owners
        for path in ENGINE_PROBES:
            async with http.get(d.url + path) as r:
                assert not 200 <= r.status < 300, f"{path} answered {r.status}"


def build_app_for_routes():
    from kvfork.server.common.config import ServerConfig
    from kvfork.server.common.state import ModelState, OneModel, Services
    from kvfork.server.watch.metrics import Registry

    class Idle:  # the routes are all that is read
        ready, dead, info = False, False, None

    model = ModelState(ServerConfig(), Idle(), ["m"])
    return build_app(Services(ServerConfig(), Registry(), OneModel(model)))


def test_no_route_answers_an_engine_probe():
    """A future route on one of the probe paths would make smg talk to kvfork as vLLM or SGLang."""
    routes = {resource.canonical for resource in build_app_for_routes().router.resources()}
    assert not routes & set(ENGINE_PROBES), routes & set(ENGINE_PROBES)


async def test_loads_count_the_request_decoding(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), engine=dict(inference_slots=2)) as d:
        async with http.get(d.url + LOADS) as r:
            assert r.status == 200
            idle = await r.json()
        assert idle["dp_rank_count"] == 1 and len(idle["loads"]) == 1  # smg drops an empty `loads`
        rank = idle["loads"][0]
        assert RANK_FIELDS <= rank.keys()
        assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["num_used_tokens"]) == (0, 0, 0)
        assert rank["max_running_requests"] == 2 and rank["max_total_num_tokens"] > 0

        async with aiohttp.ClientSession() as client:
            response = await client.post(d.url + CHAT, json=chat_body(max_tokens=LONG_RUN, ignore_eos=True,
                                                                     stream=True))
            await first_token(response)
            async with http.get(d.url + LOADS) as r:
                busy = (await r.json())["loads"][0]
            response.close()
        assert busy["num_running_reqs"] == 1 and busy["num_total_reqs"] == 1
        assert busy["num_used_tokens"] > 0 and 0 < busy["token_usage"] <= 1
        assert busy["utilization"] == 0.5
        gauges = await metrics(http, d.url)
        assert gauges["kvfork_waiting_requests"] == 0
        await until(lambda: metrics(http, d.url), lambda m: m["kvfork_running_requests"] == 0, "the stream cancelled")


async def test_the_gauges_a_gateway_scrapes_follow_the_queue(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), engine=dict(inference_slots=1)) as d:
        read = lambda: metrics(http, d.url)  # noqa: E731
        clients = [aiohttp.ClientSession() for _ in range(2)]
        streams: list[aiohttp.ClientResponse] = []
        try:
            for client in clients:  # one decodes, the other waits for the only slot
                streams.append(await client.post(d.url + CHAT, json=chat_body(
                    f"request {len(streams)}", max_tokens=LONG_RUN, ignore_eos=True, stream=True)))
            await first_token(streams[0])
            seen = await until(read, lambda m: m["kvfork_waiting_requests"] == 1, "one request waiting")
            assert seen["kvfork_running_requests"] == 1 and 0 < seen["kvfork_kv_cache_usage_perc"] <= 1
            async with http.get(d.url + LOADS) as r:
                rank = (await r.json())["loads"][0]
            assert (rank["num_running_reqs"], rank["num_waiting_reqs"]) == (1, 1)
            assert rank["num_waiting_uncached_tokens"] > 0
        finally:
            for stream in streams:
                stream.release()
            for client in clients:
                await client.close()
        await until(read, lambda m: m["kvfork_running_requests"] == 0 and m["kvfork_waiting_requests"] == 0,
                    "both cancelled")
        assert (await read())["kvfork_kv_cache_usage_perc"] == 0  # what the prefix cache keeps gives way


async def test_loads_are_open_with_api_keys_and_name_no_tenant(tiny_model_dir, http):
    """smg polls /v1/loads and reads /v1/models with no client's key: they are open like /health and /metrics,
    and say as little."""
    async with serving(tiny_model_dir("llama"), api_key=["secret-key"]) as d:
        async with http.post(d.url + CHAT, json=chat_body(max_tokens=2)) as r:
            assert r.status == 401  # every other /v1 route still needs the key
        async with http.post(d.url + CHAT, json=chat_body(max_tokens=2, session_id="private-session"),
                             headers={"Authorization": "Bearer secret-key"}) as r:
            assert r.status == 200
        texts = []
        for path in (LOADS, "/v1/models"):  # smg registers a replica by /v1/models, with no client's key
            async with http.get(d.url + path) as r:
                assert r.status == 200, path
                texts.append(await r.text())
        for secret in ("secret-key", "private-session", "tenant"):
            assert not any(secret in text for text in texts)


async def test_the_routing_key_names_no_session(tiny_model_dir, http):
    """smg reads x-smg-routing-key itself and forwards it; kvfork must not make it a named session (they are
    opt-in: the body's session_id)."""
    async with serving(tiny_model_dir("llama")) as d:
        for _ in range(2):
            async with http.post(d.url + CHAT, json=chat_body(max_tokens=2),
                                 headers={"x-smg-routing-key": "conversation-1"}) as r:
                assert r.status == 200
        assert (await metrics(http, d.url))["kvfork_named_sessions"] == 0


def test_token_rate_is_over_the_last_window():
    now = [0.0]
    rate = TokenRate(window_s=30.0, clock=lambda: now[0])
    assert rate.rate(0) == 0.0
    for t, total in [(10, 100), (20, 200), (30, 300), (40, 1300)]:
        now[0] = t
        last = rate.rate(total)
    assert last == (1300 - 100) / 30  # the base is the oldest sample at least 30 s back
