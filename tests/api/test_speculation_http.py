"""Speculative decoding over HTTP, with a scripted drafter (tests/scripted_drafts.py) in the daemon:
the same greedy text as without it on both backends (llama, qwen3, gemma3's sliding window, a
hybrid that does not speculate), /metrics counting drafted and accepted tokens by source, and a
constrained tool call that stays valid while its drafts are checked against its grammar."""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import pytest

from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from http_daemon import metrics, serving
from kvfork.backends import create_backend
from scripted_drafts import ScriptedDrafts
from tiny_hybrid_models import HYBRID_ARCHS

PROMPTS = ["the capital of France", "a list of colours: red, green", "once upon a time"]


async def completions(url: str, prompts: list[str], max_tokens: int = 32) -> list[str]:
    async with aiohttp.ClientSession() as http:
        out = []
        for text in prompts:
            async with http.post(url + "/v1/completions", json={"prompt": text, "max_tokens": max_tokens,
                                                                  "temperature": 0}) as r:
                assert r.status == 200, await r.text()
                out.append((await r.json())["choices"][0]["text"])
        return out


async def texts(folder: str, name: str, drafts: ScriptedDrafts | None, prompts: list[str],
                speculative: str = "off") -> tuple[list[str], dict]:
    async with serving(folder, create_backend(name), load=False,
                       engine={"prefix_cache_entries": 0, "speculative": speculative}) as d:
        if drafts is not None:
            d.engine.drafts = drafts
        await d.load()
        got = await completions(d.url, prompts)
        async with aiohttp.ClientSession() as http:
            return got, await metrics(http, d.url)


def spec(read: dict, kind: str) -> float:
    return sum(v for k, v in read.items() if k.startswith(f"kvfork_spec_{kind}_tokens_total"))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", HYBRID_ARCHS[0]])
async def test_greedy_text_is_the_same_with_speculation_on(backend_name, arch, tiny_model_dir, tiny_hybrid_dir):
    folder = tiny_hybrid_dir(arch) if arch in HYBRID_ARCHS else tiny_model_dir(arch)
    want, _ = await texts(folder, backend_name, None, PROMPTS)
    got, read = await texts(folder, backend_name, ScriptedDrafts(), PROMPTS + PROMPTS)  # then from what it wrote
    assert got == want + want
    rolls_back = arch not in HYBRID_ARCHS and (backend_name == "torch" or arch != "gemma3")
    if rolls_back:
        assert spec(read, "drafted") > spec(read, "accepted") > 0
        assert read['kvfork_spec_accepted_tokens_total{source="suffix"}'] > 0
        vllm = {k.split("{")[0]: v for k, v in read.items() if k.startswith("kvfork_spec_decode_")}
        assert vllm == {"kvfork_spec_decode_num_draft_tokens_total": spec(read, "drafted"),
                        "kvfork_spec_decode_num_accepted_tokens_total": spec(read, "accepted")}
    else:  # it does not speculate (a hybrid; MLX's rotating caches), and counts nothing
        assert spec(read, "drafted") == 0


REPEATING = ["one two three four five one two three four five one two three four five one two",
             "red green blue red green blue red green blue red green blue red"]


@pytest.mark.parametrize("mode", ["prompt", "suffix"])
async def test_the_daemons_own_drafters_keep_greedy_text(backend_name, mode, tiny_model_dir):
    """--speculative builds the real drafters (server/engine/worker/drafts.py): prompts that repeat, and a
    tiny random model that loops, give prompt lookup matches to draft from; the text stays the same."""
    folder = tiny_model_dir("llama")
    want, _ = await texts(folder, backend_name, None, REPEATING + REPEATING)
    got, read = await texts(folder, backend_name, None, REPEATING + REPEATING, speculative=mode)
    assert got == want
    assert spec(read, "drafted") >= spec(read, "accepted") > 0


FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}}]


async def test_a_constrained_tool_call_stays_valid_with_speculation(backend_name, tiny_model_dir):
    body = {"messages": [{"role": "user", "content": "the forecast"}], "tools": TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 96, "temperature": 0}
    drafts = ScriptedDrafts(spoil_every=2)  # half its drafts hold a token the grammar may refuse
    async with serving(tiny_model_dir("llama"), create_backend(backend_name), load=False, tool_parser="hermes",
                       engine={"prefix_cache_entries": 0}) as d:
        d.engine.drafts = drafts
        await d.load()
        calls = []
        async with aiohttp.ClientSession() as http:
            for _ in range(3):  # the later ones draft from the earlier ones' output
                async with http.post(d.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    choice = (await r.json())["choices"][0]
                assert choice["finish_reason"] == "tool_calls"
                (call,) = choice["message"]["tool_calls"]
                assert call["function"]["name"] == "get_forecast"
                jsonschema.validate(json.loads(call["function"]["arguments"]), FORECAST)
                calls.append(call["function"]["arguments"])
            read = await metrics(http, d.url)
    assert calls[0] == calls[1] == calls[2]
    assert spec(read, "accepted") > 0
    # the grammar cut the drafts at the spoiled tokens it refuses, before verification
    assert drafts.proposed_tokens > spec(read, "drafted") >= spec(read, "accepted")
