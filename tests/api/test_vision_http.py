"""A model that reads images, over HTTP (a tiny random model of each family on each backend: one daemon a family
and backend): an image
in a user turn (chat) and inside a Messages tool_result; the same image next turn reuses the prompt up to the
new text and is not encoded again; a changed image misses from its first token; two tenants share nothing;
restarted from the disk tier, the same tokens. With the text model's heads 64 wide, the KV state stored at int8 and
int4: a cache hit, n choices, two requests together and a restart answer as reuse off."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from PIL import Image

from http_daemon import TEST_ENGINE, metrics, reuse_off, serving
from kvfork.backends import create_backend
from kvfork.backends.vision import load_processing
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.pool_daemon import PoolDaemon
from kvfork.server.pool.specs import ModelSpec
from kvfork.tools.vision_model import FAMILIES, write
from tiny_models import write_model

# (family, backend): every family on both backends (backends/mlx/vision.py SERVED)
# (SmolVLM2 is SmolVLM's architecture under other names: tests/backends/test_vision.py)
CASES = [(family, backend) for backend in ("torch", "mlx") for family in FAMILIES if family != "smolvlm2"]

pytestmark = pytest.mark.asyncio(loop_scope="module")
CHAT, MESSAGES = "/v1/chat/completions", "/v1/messages"
SYSTEM = "you read the screen of a user and answer what is on it, first the window then the button " * 2
ENCODED = "kvfork_images_encoded_total"


def screenshot(seed: int, width: int = 50, height: int = 40) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return f"data:image/png;base64,{base64.b64encode(out.getvalue()).decode()}"


def turn(image: str, text: str = "what is on the screen?") -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": image}}]}]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def case(request) -> tuple[str, str]:
    return request.param


@pytest.fixture(scope="module")
def backend(case) -> str:
    return case[1]


@pytest.fixture(scope="module")
def folder(case, tmp_path_factory):
    """Each family's tiny model in turn (SmolVLM's, Qwen2.5-VL's, Gemma 3's)."""
    return str(write(tmp_path_factory.mktemp(case[0]), family=case[0]))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def daemon(folder, backend):
    async with serving(folder, create_backend(backend), served_model_name=["tiny"]) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="module")
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def image_tokens(folder: str, width: int = 50, height: int = 40) -> int:
    """The tokens an image of this size takes in the family's prompt (its keys)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    processing = load_processing(folder, tokenizer)
    return tokenizer.encode(processing.prompt_text(width, height), add_special_tokens=False).count(
        processing.image_token_id)


def sliding(folder: str) -> bool:
    """Whether the model has sliding-window layers (the tiny Gemma 3's window is 8): a state of one serves a
    clone only near its end, so a prompt sharing just the text before an image reuses nothing."""
    return "sliding_attention" in json.loads(Path(folder, "config.json").read_text())["text_config"].get(
        "layer_types", [])


async def chat(http, daemon, messages: list[dict], status: int = 200, **extra) -> dict:
    body = {"messages": messages, "temperature": 0, "max_tokens": 4, **extra}
    async with http.post(daemon.url + CHAT, json=body) as r:
        assert r.status == status, await r.text()
        return await r.json()


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def encoded(http, daemon) -> float:
    return (await metrics(http, daemon.url)).get(ENCODED, 0.0)


async def test_the_same_image_next_turn_is_reused_and_not_encoded_again(http, daemon):
    image = screenshot(1)
    before = await encoded(http, daemon)
    first = await chat(http, daemon, turn(image), cache_salt="reuse")
    assert await encoded(http, daemon) == before + 1
    answer = first["choices"][0]["message"]["content"]
    follow_up = turn(image) + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": "and the button?"}]
    second = await chat(http, daemon, follow_up, cache_salt="reuse")
    assert cached(second) >= first["usage"]["prompt_tokens"] - 1  # all of the first turn's prompt
    assert await encoded(http, daemon) == before + 1  # reused with its state: never encoded again
    cold = await chat(http, daemon, follow_up, cache_salt="cold")  # no reuse: the same answer
    assert cached(cold) == 0
    assert cold["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


async def test_a_changed_image_misses_from_its_first_token(http, daemon, folder):
    first = await chat(http, daemon, turn(screenshot(2)), cache_salt="changed")
    same_size = await chat(http, daemon, turn(screenshot(3)), cache_salt="changed")
    text_before = await chat(http, daemon, turn(screenshot(2))[:1] + [{"role": "user", "content": "x"}],
                             cache_salt="probe")
    # the text before it (SmolVLM: and its first tile's marks), none of its keys
    assert cached(same_size) <= first["usage"]["prompt_tokens"] - image_tokens(folder)
    assert cached(same_size) > 0 or sliding(folder)
    assert cached(text_before) == 0
    again = await chat(http, daemon, turn(screenshot(2)), cache_salt="changed")
    assert cached(again) == first["usage"]["prompt_tokens"] - 1


async def test_two_tenants_share_nothing(http, daemon):
    image = screenshot(4)
    before = await encoded(http, daemon)
    await chat(http, daemon, turn(image), cache_salt="tenant-a")
    other = await chat(http, daemon, turn(image), cache_salt="tenant-b")
    assert cached(other) == 0
    assert await encoded(http, daemon) == before + 2  # the encoder's cache is not shared either


async def test_an_image_inside_a_messages_tool_result(http, daemon, folder):
    png = screenshot(5).split(",", 1)[1]
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]}],
        "tools": [{"name": "screenshot", "description": "the screen", "input_schema": {"type": "object"}}]}
    before = await encoded(http, daemon)
    async with http.post(daemon.url + MESSAGES, json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
    assert reply["usage"]["input_tokens"] > image_tokens(folder)  # the image's tokens are in the prompt
    assert await encoded(http, daemon) == before + 1
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}
    async with http.post(daemon.url + MESSAGES + "/count_tokens", json=count) as r:
        assert r.status == 200, await r.text()
        assert (await r.json())["input_tokens"] == reply["usage"]["input_tokens"]  # counted without encoding
    assert await encoded(http, daemon) == before + 1


async def test_an_image_url_is_refused_for_a_vision_model(http, daemon):
    messages = turn("https://example.com/a.png")
    async with http.post(daemon.url + CHAT, json={"messages": messages, "max_tokens": 2}) as r:
        assert r.status == 400
        assert "data URL" in (await r.json())["error"]["message"]


@pytest.mark.usefixtures("disk_beats_prefill")
async def test_restart_from_the_disk_tier_gives_the_same_tokens(folder, backend, http):
    messages = turn(screenshot(6))
    async with serving(folder, create_backend(backend)) as first:
        want = await chat(http, first, messages, max_tokens=6)
    async with serving(folder, create_backend(backend)) as second:  # the first one's cache spilled at its close
        got = await chat(http, second, messages, max_tokens=6)
        assert cached(got) > 0
        assert await encoded(http, second) == 0
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]


async def test_a_running_requests_image_prompt_is_cloned_by_a_second(folder, backend, http):
    if sliding(folder):  # its window of 8 is overwritten by the donor's first 8 decode steps: no clone is possible
        pytest.skip("a sliding-window donor that has decoded past its window holds no state at the shared prefix")
    # no cache: reuse can only be a donor, which decodes without drafts so it is still running when asked
    engine = dict(prefix_cache_entries=0, active_prefix_reuse_min_tokens=1, speculative="off")
    image = screenshot(7)
    async with serving(folder, create_backend(backend), engine=engine) as d:
        body = {"messages": turn(image), "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
                "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(d.url + CHAT, json=body) as donor:
            frames = (line async for line in donor.content if line.startswith(b"data: "))
            await anext(frames)
            await anext(frames)  # its first token: its prompt is committed, and it decodes for seconds more
            recipient = await chat(http, d, turn(image) + [{"role": "assistant", "content": "a window"},
                                                           {"role": "user", "content": "and the button?"}])
        seen = await metrics(http, d.url)
    assert cached(recipient) > image_tokens(folder) and seen['kvfork_reused_tokens_total{source="donor"}'] == cached(recipient)
    assert seen[ENCODED] == 1  # the recipient's image came with the donor's state


async def test_diagnostics_name_a_changed_image_messages_changed(http, daemon, folder):
    def body(seed: int, previous: str | None) -> dict:
        png = screenshot(seed).split(",", 1)[1]
        return {"model": "tiny", "max_tokens": 2, "temperature": 0, "system": SYSTEM,
                "diagnostics": {"previous_message_id": previous}, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "what is on the screen?"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]}

    async with http.post(daemon.url + MESSAGES, json=body(8, None)) as r:
        first = await r.json()
    async with http.post(daemon.url + MESSAGES, json=body(9, first["id"])) as r:
        second = await r.json()
    miss, account = second["diagnostics"]["cache_miss_reason"], second["kvfork_cache"]
    prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    assert miss["type"] == "messages_changed"
    assert account["shared_tokens"] + miss["cache_missed_input_tokens"] == prompt
    assert 0 < account["shared_tokens"] <= prompt - image_tokens(folder)  # up to the image's first token


async def test_a_pool_model_fetched_at_its_first_load_reads_images_from_then_on(tmp_path, http):
    """Several models: a vision model still to be downloaded is unknown until its first load fetches it; from
    then on its folder says it reads images (read again at each load, kept while it is unloaded)."""
    vision = str(write(tmp_path / "vision", family="smolvlm"))
    specs = [ModelSpec("text", str(write_model(tmp_path / "text", "llama"))),
             ModelSpec("vision", "org/vision", fetch=lambda progress: vision)]
    daemon = PoolDaemon(ServerConfig(port=0, shutdown_grace=1.0), EngineConfig(**TEST_ENGINE),
                        specs, "torch", lambda: create_backend("torch"))
    await daemon.listen()
    try:
        await daemon.load()
        refused = await chat(http, daemon, turn(screenshot(10)), status=400, model="vision")  # not here yet
        assert refused["error"]["code"] == "unsupported_content"
        await chat(http, daemon, [{"role": "user", "content": "hello"}], model="vision")  # fetched and loaded
        await chat(http, daemon, turn(screenshot(10)), model="vision")
    finally:
        await daemon.close()


async def test_a_daemon_still_loading_its_vision_model_knows_it_reads_images(folder):
    """Its requests' checks run before the model is acquired: an image waits for it (or hears not_ready), never
    refused as a text model's."""
    from types import SimpleNamespace

    from kvfork.server.common.state import ModelState, OneModel

    state = ModelState(ServerConfig(), SimpleNamespace(model_path=folder), ["tiny"])
    assert state.tokenizer is None and OneModel(state).reads_images(None)
    state.close()


# (family, backend, storage): each family on both backends, at int8 on one and int4 on the other
STORED = [("smolvlm", "torch", "int8"), ("smolvlm", "mlx", "int4"), ("qwen2_5_vl", "torch", "int4"),
          ("qwen2_5_vl", "mlx", "int8"), ("gemma3", "torch", "int8"), ("gemma3", "mlx", "int4")]


@pytest.mark.usefixtures("disk_beats_prefill", "kvfork_home")
@pytest.mark.parametrize("family,backend,dtype", STORED)
async def test_an_image_prompt_reused_answers_as_reuse_off_at_a_quantized_storage(tmp_path, http, family, backend,
                                                                                  dtype):
    folder = str(write(tmp_path / family, family=family, head_dim=64))
    engine = dict(prefix_cache_entries=4, prefix_cache_disk_bytes=1 << 30, kv_cache_dtype=dtype)
    image = screenshot(8)
    asked = turn(image) + [{"role": "assistant", "content": "a window"}, {"role": "user", "content": "and the button?"}]

    async def texts(d, messages, salt: str = "", **extra) -> tuple[list[str], int]:
        reply = await chat(http, d, messages, max_tokens=8, ignore_eos=True, **(reuse_off(salt) if salt else {}),
                           **extra)
        return [c["message"]["content"] for c in reply["choices"]], cached(reply)

    async with serving(folder, create_backend(backend), engine=engine) as d:
        assert d.engine.info.kv_dtype.startswith(dtype)
        await texts(d, turn(image))
        cold, reused = await texts(d, asked, salt="hit")
        assert reused == 0
        hit, reused = await texts(d, asked)  # from the first turn's prompt, the image in it
        assert hit == cold and (reused > image_tokens(folder) or sliding(folder))
        choices, _ = await texts(d, asked, n=2)
        assert choices == cold * 2  # choice 1 starts from a clone of choice 0's prompt
        others = [turn(screenshot(9), "the window?"), turn(screenshot(9), "the window, at length?")]
        alone = [(await texts(d, m, salt=f"run{i}"))[0] for i, m in enumerate(others)]
        both = await asyncio.gather(*(texts(d, m) for m in others))
        assert [t for t, _ in both] == alone
    async with serving(folder, create_backend(backend), engine=engine) as d:  # the first one's cache spilled
        restored, reused = await texts(d, asked)
        assert reused > 0 and restored == cold
        assert await encoded(http, d) == 0 or sliding(folder)
