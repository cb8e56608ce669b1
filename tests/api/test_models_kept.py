"""What a model's unload keeps for its next load (server/pool/kept.py): a return to the model reads and converts
nothing again and answers the same greedy tokens as its fresh load; a changed folder is read again; kept
weights count in the memory budget: in its room, dropped first when a load needs the bytes, else lent by the
loaded model's KV budget (the default budget's case), called back as soon as a request needs the bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import aiohttp
import pytest

from http_daemon import chat_body
from kvfork.backends.device_memory import weights_on_disk
from kvfork.backends.torch import loading
from kvfork.server.text.tokenizer import PromptTokenizer
from test_models_http import KV, pool, three  # noqa: F401 (three: the fixture)
from tiny_models import write_model

@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The folders whose weights were read, in order."""
    seen: list[str] = []
    read = loading.read

    def counted(folder, device, shards):
        seen.append(str(Path(folder).resolve()))
        return read(folder, device, shards)

    monkeypatch.setattr(loading, "read", counted)
    return seen


@pytest.fixture
def tokenizers(monkeypatch) -> list[str]:
    """The folders whose tokenizers were loaded, in order."""
    seen: list[str] = []
    load = PromptTokenizer.load.__func__  # type: ignore[attr-defined]

    def counted(cls, folder, *args, **kwargs):
        seen.append(str(Path(folder).resolve()))
        return load(cls, folder, *args, **kwargs)

    monkeypatch.setattr(PromptTokenizer, "load", classmethod(counted))
    return seen


def weights(models: dict[str, str]) -> int:
    return max(weights_on_disk(p) for p in models.values())


def one_at_a_time(models: dict[str, str], kept: int, kv: int = KV, **engine_config):
    """A daemon loading one model at a time, each with a KV budget of `kv`, and room in its budget for `kept`
    models' weights beside it."""
    return pool(models, engine={"kv_budget_bytes": kv, **engine_config}, max_loaded_models=1,
                budget=weights(models) + kv + kept * weights(models))


async def answer(http, daemon, model: str, text: str = "the capital of France") -> str:
    async with http.post(daemon.url + "/v1/chat/completions",
                         json=chat_body(text, model=model, max_tokens=8, temperature=0)) as r:
        body = await r.json()
        assert r.status == 200, body
        return body["choices"][0]["message"]["content"]


def read(models: dict[str, str], *names: str) -> list[str]:
    return [str(Path(models[n]).resolve()) for n in names]


def kept(daemon) -> set[str]:
    return daemon.pool.kept.names()


def lent(daemon) -> set[str]:
    return daemon.pool.kept.lent()


async def test_a_returned_model_reads_nothing_again_and_answers_as_fresh(three, reads, tokenizers):
    async with aiohttp.ClientSession() as http, one_at_a_time(three, kept=1) as daemon:
        fresh = [await answer(http, daemon, "a"), await answer(http, daemon, "a", "a different question")]
        await answer(http, daemon, "b")
        assert kept(daemon) == {"a"}
        back = [await answer(http, daemon, "a"), await answer(http, daemon, "a", "a different question")]
        assert back == fresh
        assert kept(daemon) == {"b"}
        assert reads == tokenizers == read(three, "a", "b")  # a's return read no weights, loaded no tokenizer


async def test_a_changed_folder_is_read_again(three, reads, tmp_path):
    models = {**three, "a": str(write_model(tmp_path / "a", "llama", seed=0))}
    async with aiohttp.ClientSession() as http, one_at_a_time(models, kept=1) as daemon:
        await answer(http, daemon, "a")
        await answer(http, daemon, "b")
        weights = next(Path(models["a"]).glob("*.safetensors"))
        stat = weights.stat()
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        await answer(http, daemon, "a")
        assert reads == read(models, "a", "b", "a")


async def test_kept_weights_are_dropped_when_a_load_needs_the_room(three, reads):
    # a KV budget below a model's weights lends them no room: what is kept is in the budget's room alone
    async with aiohttp.ClientSession() as http, one_at_a_time(three, kept=1, kv=weights(three) // 2,
                                                              max_context=128) as daemon:
        await answer(http, daemon, "a")
        await answer(http, daemon, "b")
        await answer(http, daemon, "c")  # b's kept weights take the room a's held: a's, kept longer, go
        assert kept(daemon) == {"b"}
        await answer(http, daemon, "a")  # c's unload keeps c's, so b's go
        assert kept(daemon) == {"c"}
        await answer(http, daemon, "c")
        assert reads == read(three, "a", "b", "c", "a")


async def test_without_room_in_the_budget_the_loaded_models_kv_budget_lends_it(three, reads):
    async with aiohttp.ClientSession() as http, one_at_a_time(three, kept=0) as daemon:
        fresh = await answer(http, daemon, "a")
        await answer(http, daemon, "b")
        assert kept(daemon) == lent(daemon) == {"a"}
        assert await answer(http, daemon, "a") == fresh
        assert lent(daemon) == {"b"}
        await answer(http, daemon, "c")  # c's KV budget lends a's and b's weights room
        assert lent(daemon) == {"a", "b"}
        assert reads == read(three, "a", "b", "c")


async def test_a_request_that_needs_the_lent_bytes_calls_them_back(three, reads):
    # b's KV budget holds a's weights and 256 KiB: a request reserving more calls a's weights back
    kv = weights(three) + 256 * 1024
    async with aiohttp.ClientSession() as http, one_at_a_time(three, kept=0, kv=kv, max_context=1024) as daemon:
        await answer(http, daemon, "a")
        await answer(http, daemon, "b")
        assert lent(daemon) == {"a"}
        body = chat_body(model="b", max_tokens=900, stream=True)  # 512 bytes a token: 450 KiB reserved
        async with http.post(daemon.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            async for line in r.content:  # to its first token: admitted, its bytes reserved
                if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    break
        assert kept(daemon) == set()
        await answer(http, daemon, "a")
        assert reads == read(three, "a", "b", "a")
