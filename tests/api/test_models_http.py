"""Several models in one daemon, over HTTP: switching by `model`, LRU eviction under a budget that holds
two, pinning, --model-ttl, a request waiting for a loading model, grouping, an unknown model, a model that
fails to load, a conversation resumed on a reloaded model from its spilled prefix cache, and switches between
tenants (a switch waits for another tenant's running requests; a tenant's switches of another's model are
spaced by --model-switch-interval)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from http_daemon import TEST_ENGINE, chat_body, metrics, sse_events
from kvfork.backends import create_backend
from kvfork.backends.device_memory import weights_on_disk
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.pool_daemon import PoolDaemon
from kvfork.server.pool import pool as pool_module
from kvfork.server.launch.model_source import model_source
from kvfork.server.pool.specs import model_specs
from tiny_models import write_model

KV = 32 * 1024 * 1024
CHAT = "/v1/chat/completions"
KEYS = "key-hostile hostile\nkey-innocent innocent\n"


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> dict[str, str]:
    """Three tiny llama models of different weights (so different disk-tier fingerprints)."""
    return {name: str(write_model(tmp_path_factory.mktemp(name), "llama", seed=i))
            for i, name in enumerate(("a", "b", "c"))}


@asynccontextmanager
async def pool(models: dict[str, str], hold: int = 2, backend: str = "torch", engine: dict | None = None,
               budget: int | None = None, **server):
    """A daemon of `models` under a budget that holds `hold` of them (weights and KV), or of `budget` bytes;
    `engine`: more settings."""
    weights = max(weights_on_disk(p) for p in models.values())
    config = ServerConfig(model=[f"{n}={p}" for n, p in models.items()], port=0, shutdown_grace=1.0,
                          memory_budget_bytes=budget or hold * (weights + KV) + KV // 2, **server)
    engine_config = EngineConfig(**{**TEST_ENGINE, "kv_budget_bytes": KV, **(engine or {})})
    daemon = PoolDaemon(config, engine_config, model_specs(config.model, None, model_source), backend,
                        lambda: create_backend(backend))
    await daemon.listen()
    try:
        await daemon.load()
        yield daemon
    finally:
        await daemon.close()


async def ask(http, daemon, model: str, text: str = "the capital of France", **extra) -> dict:
    async with http.post(daemon.url + CHAT, json=chat_body(text, model=model, max_tokens=4, **extra)) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def listed(http, daemon) -> dict[str, bool]:
    async with http.get(daemon.url + "/v1/models") as r:
        return {card["id"]: card["loaded"] for card in (await r.json())["data"]}


async def test_switch_by_model_evicts_the_least_recently_used(three):
    async with aiohttp.ClientSession() as http, pool(three) as daemon:
        assert await listed(http, daemon) == {"a": True, "b": False, "c": False}
        assert (await ask(http, daemon, "b"))["model"] == "b"
        assert await listed(http, daemon) == {"a": True, "b": True, "c": False}
        await ask(http, daemon, "a")  # a is now the more recent
        await ask(http, daemon, "c")  # room for c: b goes
        assert await listed(http, daemon) == {"a": True, "b": False, "c": True}
        text = await (await http.get(daemon.url + "/metrics")).text()
        assert 'model_name="c"' in text and 'kvfork_num_requests_running{model_name="a"}' in text


async def test_a_pinned_model_stays(three):
    async with aiohttp.ClientSession() as http, pool(three, pin=["a"]) as daemon:
        for model in ("b", "c", "b"):
            await ask(http, daemon, model)
            assert (await listed(http, daemon))["a"]


async def test_an_idle_model_unloads_after_its_ttl(three):
    async with aiohttp.ClientSession() as http, pool(three, model_ttl=0.2) as daemon:
        await ask(http, daemon, "b")
        for _ in range(200):
            if not any((await listed(http, daemon)).values()):
                break
            await asyncio.sleep(0.05)
        assert await listed(http, daemon) == {"a": False, "b": False, "c": False}
        assert (await ask(http, daemon, "a"))["choices"][0]["message"]["content"] is not None


async def test_requests_for_a_loading_model_wait_and_are_grouped(three):
    """Requests for b and c arrive while only a is loaded and one model fits: every one succeeds, and the
    models load in the order of their first request, each once (b b c c, not b c b c)."""
    async with aiohttp.ClientSession() as http, pool(three, hold=1) as daemon:
        order = ["b", "c", "b", "c"]
        answers = await asyncio.gather(*(ask(http, daemon, m, stream=False) for m in order))
        assert [a["model"] for a in answers] == order
        assert await listed(http, daemon) == {"a": False, "b": False, "c": True}
        loads = await metrics(http, daemon.url)
        assert loads['kvfork_model_loads_total{model_name="b",outcome="loaded"}'] == 1
        assert loads['kvfork_model_loads_total{model_name="c",outcome="loaded"}'] == 1


async def test_an_unknown_model_is_a_404_in_each_api_shape(three):
    async with aiohttp.ClientSession() as http, pool(three) as daemon:
        async with http.post(daemon.url + CHAT, json=chat_body(model="nope")) as r:
            body = await r.json()
            assert r.status == 404 and body["error"]["code"] == "model_not_found"
            assert "'a', 'b', 'c'" in body["error"]["message"]
        anthropic = {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        async with http.post(daemon.url + "/v1/messages", json=anthropic) as r:
            body = await r.json()
            assert r.status == 404 and body["type"] == "error" and "'a', 'b', 'c'" in body["error"]["message"]


async def test_a_model_that_fails_to_load_leaves_the_others_serving(three, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(Path(three["a"], "config.json").read_text())  # no weights
    async with aiohttp.ClientSession() as http, pool({**three, "broken": str(broken)}) as daemon:
        async with http.post(daemon.url + CHAT, json=chat_body(model="broken", max_tokens=2)) as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "model_load_failed", body
        await ask(http, daemon, "a")
        await ask(http, daemon, "b")


async def test_a_load_error_names_paths_only_to_the_metrics_key(three, tmp_path):
    """/health and the 503 say which model failed; its own error (the folder's path, what refused it) goes to
    the log and to the holder of --metrics-key alone."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(Path(three["a"], "config.json").read_text())
    async with aiohttp.ClientSession() as http, pool({"a": three["a"], "empty": str(empty)},
                                                     metrics_key="m-key") as daemon:
        message = await refused(http, daemon, "empty")
        async with http.get(daemon.url + "/health") as r:
            shown = (await r.json())["models"]["empty"]["error"]
        async with http.get(daemon.url + "/health", headers={"Authorization": "Bearer m-key"}) as r:
            full = (await r.json())["models"]["empty"]["error"]
    assert str(tmp_path) not in message + shown and "safetensors" not in message + shown
    assert "'empty'" in message and "'empty'" in shown
    assert str(empty) in full and "no *.safetensors" in full


REFUSED = [  # each refused by its body, whatever model it names
    (CHAT, {**chat_body(model="b"), "n": 99}),
    ("/v1/completions", {"model": "b", "prompt": "hi", "stop": ["x"] * 9}),
    ("/v1/messages", {"model": "b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                      "stop_sequences": ["x" * 300]}),
    ("/v1/messages/count_tokens", {"model": "b", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}),
    ("/v1/responses", {"model": "b", "input": "hi", "tools": [{"type": "function", "name": f"f{i}"}
                                                               for i in range(200)]}),
    (CHAT, {**chat_body(model="b"), "tool_choice": "required"}),
]


async def test_a_refused_request_loads_and_unloads_nothing(three):
    """Requests naming b, each refused for its body (a 400), leave a, the one model that fits, serving:
    nothing loads or unloads for them, its context and vocabulary read from its folder."""
    config = json.loads(Path(three["b"], "config.json").read_text())
    context, vocab = config["max_position_embeddings"], config["vocab_size"]
    over_context = [(CHAT, chat_body("x" * (32 * context + 1), model="b")),  # past --max-prompt-chars
                    ("/v1/completions", {"model": "b", "prompt": list(range(context))})]
    over_vocabulary = [(CHAT, {**chat_body(model="b"), "logit_bias": {str(vocab): 1}}),
                       (CHAT, {**chat_body(model="b"), "stop_token_ids": [vocab]}),
                       ("/v1/completions", {"model": "b", "prompt": "hi", "logit_bias": {str(vocab): 1}}),
                       ("/v1/completions", {"model": "b", "prompt": [1, vocab]})]
    async with aiohttp.ClientSession() as http, pool(three, hold=1) as daemon:
        await ask(http, daemon, "a")
        for path, body in REFUSED + over_context + over_vocabulary:
            async with http.post(daemon.url + path, json=body) as r:
                assert r.status == 400, (path, await r.text())
        assert await listed(http, daemon) == {"a": True, "b": False, "c": False}
        counts = await metrics(http, daemon.url)
        changes = {k: v for k, v in counts.items() if k.startswith(("kvfork_model_loads_total",
                                                                     "kvfork_model_unloads_total")) and v}
        assert changes == {'kvfork_model_loads_total{model_name="a",outcome="loaded"}': 1}


async def test_the_listing_states_the_context_requests_get(three):
    """/v1/models states each model's context as its requests get it (--max-context over its config's), the
    one reading the pool made of its folder, loaded or not."""
    async with aiohttp.ClientSession() as http, pool(three, hold=1, engine=dict(max_context=1024)) as daemon:
        async with http.get(daemon.url + "/v1/models") as r:
            cards = {card["id"]: (card["max_model_len"], card["loaded"]) for card in (await r.json())["data"]}
    assert cards == {"a": (1024, True), "b": (1024, False), "c": (1024, False)}


async def test_count_tokens_loads_no_model(three):
    """count_tokens on a model not loaded counts with its tokenizer alone: a stays loaded, and the count is
    the one b gives once loaded."""
    messages = {"model": "b", "system": "be brief", "messages": [{"role": "user", "content": "the capital of France"}]}
    async with aiohttp.ClientSession() as http, pool(three, hold=1) as daemon:
        await ask(http, daemon, "a")
        async with http.post(daemon.url + "/v1/messages/count_tokens", json=messages) as r:
            cold = await r.json()
            assert r.status == 200, cold
        assert await listed(http, daemon) == {"a": True, "b": False, "c": False}
        await ask(http, daemon, "b")
        async with http.post(daemon.url + "/v1/messages/count_tokens", json=messages) as r:
            assert await r.json() == cold and cold["input_tokens"] > 0


async def refused(http, daemon, model: str) -> str:
    async with http.post(daemon.url + CHAT, json=chat_body(model=model, max_tokens=2)) as r:
        body = await r.json()
        assert r.status == 503 and body["error"]["code"] == "model_load_failed", body
        return body["error"]["message"]


async def test_a_broken_model_does_not_evict_a_healthy_one(three, tmp_path, monkeypatch):
    """With room for one model: a folder with no weights is refused from its config and headers, and a folder
    whose weights do not fit its config fails its load once; asked again while unchanged, each answers its
    error without unloading the model that serves."""
    empty, misfit = tmp_path / "empty", tmp_path / "misfit"
    empty.mkdir()
    (empty / "config.json").write_text(Path(three["a"], "config.json").read_text())
    shutil.copytree(three["b"], misfit)
    config = json.loads((misfit / "config.json").read_text())
    (misfit / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2}))
    models = {"a": three["a"], "empty": str(empty), "misfit": str(misfit)}
    async with aiohttp.ClientSession() as http, pool(models, hold=1) as daemon:
        await ask(http, daemon, "a")
        assert await refused(http, daemon, "empty") == "model 'empty' could not be loaded; the daemon's log says why"
        assert (await listed(http, daemon))["a"]
        first = await refused(http, daemon, "misfit")  # its headers read well: a is unloaded for its load
        await ask(http, daemon, "a")
        assert await refused(http, daemon, "misfit") == first
        assert await listed(http, daemon) == {"a": True, "empty": False, "misfit": False}
        counts = await metrics(http, daemon.url)
        assert counts['kvfork_model_loads_total{model_name="a",outcome="loaded"}'] == 2
        assert counts['kvfork_model_loads_total{model_name="misfit",outcome="failed"}'] == 2
        monkeypatch.setattr(pool_module, "FAILED_LOAD_HOLD_S", 0.0)  # the failure's hold over: tried again
        assert await refused(http, daemon, "misfit") == first
        assert not (await listed(http, daemon))["a"]
        (misfit / "config.json").write_text(json.dumps(config))  # mended: loaded on the next request
        await ask(http, daemon, "misfit")


@pytest.mark.parametrize("a, kv_cache_dtype", [("llama", "auto"), ("qwen3_5", "auto"), ("wide llama", "int8")],
                         ids=["llama", "qwen3_5", "llama-int8"])
async def test_a_conversation_resumes_from_its_spilled_cache_after_a_switch(three, tiny_hybrid_dir, tmp_path, a,
                                                                            kv_cache_dtype, disk_beats_prefill):
    """A -> B -> A with a budget of one model: A's prefix cache spills to its disk tier as A unloads and the
    return to A restores it: the same greedy tokens as without the switch, the prefix counted cached. A
    hybrid A's recurrent checkpoints come back with it; KV stored in int8 (heads 64 wide, so groups of 64
    divide them) spills and comes back in int8."""
    system = "a long shared system prompt that every request here sends, word for word, " * 3
    first = [{"role": "system", "content": system}, {"role": "user", "content": "hello there"}]
    models = {"qwen3_5": {**three, "a": tiny_hybrid_dir("qwen3_5")}, "llama": three,
              "wide llama": {name: str(write_model(tmp_path / name, "llama", seed=i, head_dim=64))
                             for i, name in enumerate(("a", "b"))}}[a]
    async with aiohttp.ClientSession() as http, pool(models, hold=1, engine={"kv_cache_dtype": kv_cache_dtype}) as daemon:
        answer = await ask_messages(http, daemon, "a", first)
        again = await ask_messages(http, daemon, "a", first)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        await ask(http, daemon, "b")
        assert await listed(http, daemon) == {name: name == "b" for name in models}
        back = await ask_messages(http, daemon, "a", first)
        assert back["choices"][0]["message"]["content"] == answer["choices"][0]["message"]["content"]
        assert back["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
            again["usage"]["prompt_tokens_details"]["cached_tokens"]


async def ask_messages(http, daemon, model: str, messages: list) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 6}
    async with http.post(daemon.url + CHAT, json=body) as r:
        out = await r.json()
        assert r.status == 200, out
        return out


async def test_a_stream_waiting_for_its_model_hears_keep_alives(three):
    async with aiohttp.ClientSession() as http, pool(three, hold=1, sse_keepalive=0.01) as daemon:
        body = chat_body(model="b", max_tokens=4, stream=True)
        async with http.post(daemon.url + CHAT, json=body) as r:
            assert r.status == 200
            lines = await sse_events(r)
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
        assert ": keep-alive" in lines[:first_data]
        assert lines[-1] == "data: [DONE]" and '"content"' in "".join(lines)


async def test_a_running_request_finishes_before_its_model_unloads(three):
    """A long answer on a, then a request for b (one model fits): a's answer completes whole, then b loads."""
    async with aiohttp.ClientSession() as http, pool(three, hold=1) as daemon:
        long = asyncio.create_task(ask_long(http, daemon))
        while not daemon.pool.models["a"].users:
            await asyncio.sleep(0.01)
        other = await ask(http, daemon, "b")
        answer = await long
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 64
        assert other["model"] == "b"


async def ask_long(http, daemon) -> dict:
    body = chat_body(model="a", max_tokens=64, ignore_eos=True)
    async with http.post(daemon.url + CHAT, json=body) as r:
        assert r.status == 200
        return await r.json()


def runner_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvfork-runner") and t.is_alive()}


async def test_shutdown_during_a_load_leaves_no_runner_and_no_partial_file(three, kvfork_home):
    before = runner_threads()  # other tests' daemons in this process are not this one's
    async with aiohttp.ClientSession() as http:
        async with pool(three, hold=1) as daemon:
            await ask(http, daemon, "a", "a prompt long enough to be kept in the prefix cache, word for word " * 2)
            waiting = asyncio.create_task(http.post(daemon.url + CHAT, json=chat_body(model="b", max_tokens=2)))
            while daemon.pool.loading != "b":
                await asyncio.sleep(0.005)
        response = await waiting
        assert response.status in (200, 503)
        response.release()
    assert not runner_threads() - before
    assert not list(Path(kvfork_home, "kv").rglob("*.tmp"))


async def test_mlx_holds_one_model_at_a_time(three):
    """On MLX one model runs at a time, whatever the budget holds: a -> b -> a answers the same on a."""
    async with aiohttp.ClientSession() as http, pool(three, backend="mlx") as daemon:
        first = await ask(http, daemon, "a")
        await ask(http, daemon, "b")
        assert await listed(http, daemon) == {"a": False, "b": True, "c": False}
        back = await ask(http, daemon, "a")
        assert back["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


@pytest.mark.parametrize("extra, says", [(["--served-model-name", "x"], "NAME=PATH"),
                                         (["--pin", "nope"], "--pin 'nope'"),
                                         (["--model", "a=/tmp"], "two models are named 'a'")])
def test_flags_that_do_not_combine_with_several_models_exit_2(three, extra, says, capsys):
    from kvfork.server.cli import main as kvfork

    with pytest.raises(SystemExit) as e:
        kvfork(["serve", "--model", f"a={three['a']}", "--model", f"b={three['b']}", *extra])
    assert e.value.code == 2 and says in capsys.readouterr().err


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


async def ask_as(http, daemon, key: str, model: str, max_tokens: int = 4) -> dict:
    body = chat_body(model=model, max_tokens=max_tokens, ignore_eos=True)
    async with http.post(daemon.url + CHAT, json=body, headers=auth(key)) as r:
        answer = await r.json()
        assert r.status == 200, answer
        return answer


async def test_another_tenants_switch_waits_for_the_running_request_whatever_the_timeout(three, keys_file):
    """One model fits, and the switch timeout is 0: the hostile tenant's request for b waits until the
    innocent's long answer on a has ended whole (before, the switch cancelled it at once)."""
    async with aiohttp.ClientSession() as http, pool(three, hold=1, api_keys_file=keys_file,
                                                     model_switch_timeout=0.0) as daemon:
        long = asyncio.create_task(ask_as(http, daemon, "key-innocent", "a", max_tokens=64))
        while not daemon.pool.models["a"].users:
            await asyncio.sleep(0.01)
        other = await ask_as(http, daemon, "key-hostile", "b")
        answer = await long
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 64
        assert other["model"] == "b"


async def test_a_tenant_switches_another_tenants_model_once_per_interval(three, keys_file):
    """The hostile tenant takes the one model's room for b (its switch); the innocent takes a back (its own
    switch); the hostile tenant's next request for b waits for its interval, and the innocent keeps a."""
    async with aiohttp.ClientSession() as http, pool(three, hold=1, api_keys_file=keys_file,
                                                     model_switch_interval=600.0) as daemon:
        await ask_as(http, daemon, "key-innocent", "a")
        await ask_as(http, daemon, "key-hostile", "b")
        await ask_as(http, daemon, "key-innocent", "a")
        again = asyncio.create_task(ask_as(http, daemon, "key-hostile", "b"))
        for _ in range(3):
            assert (await ask_as(http, daemon, "key-innocent", "a"))["model"] == "a"
        assert not again.done() and await listed(http, daemon) == {"a": True, "b": False, "c": False}
        loads = await metrics(http, daemon.url)
        assert loads['kvfork_model_loads_total{model_name="b",outcome="loaded"}'] == 1
    with pytest.raises(AssertionError, match="shutting down"):  # it waited until the daemon closed
        await again
