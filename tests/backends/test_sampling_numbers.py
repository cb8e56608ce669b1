"""Input that would break sampling never reaches it: temperatures too small to divide by sample
greedily; every 64-bit seed works on both backends, and anything wider is a 400."""

from __future__ import annotations

import pytest
from backend_fixtures import backend, backend_name, fresh, greedy, prompt  # noqa: F401  (fixtures)
from http_daemon import chat_body, serving

from kvfork.backends import create_backend
from kvfork.backends.base import SamplerState, SamplingParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture
def logits(backend):
    s, out = fresh(backend, prompt(12, seed=3))
    yield out
    backend.release(s)


def draws(b, logits, params: SamplingParams, n: int = 16) -> list[int]:
    state = SamplerState(params)
    return [b.sample(logits, [state])[0].token for _ in range(n)]


def test_a_temperature_too_small_to_divide_by_samples_greedily(backend, logits):
    want = greedy(backend, logits)
    for t in (1e-40, 9.9e-6):
        assert draws(backend, logits, SamplingParams(temperature=t, seed=1), 4) == want * 4


def test_every_64_bit_seed_draws_on_both_backends(backend, logits):
    hot = dict(temperature=30.0)
    streams = {seed: draws(backend, logits, SamplingParams(**hot, seed=seed))
               for seed in (-1, 2**63, 2**64 - 1, -2**63, 0)}
    assert streams[-1] == streams[2**64 - 1]  # a negative seed is its two's complement
    assert streams[-2**63] == streams[2**63]
    assert streams[0] != streams[2**64 - 1]


def test_a_seed_wider_than_64_bits_is_refused():
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)


@pytest.fixture
async def torch_daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), create_backend("torch")) as d:
        yield d


async def completion(http, daemon, **extra) -> tuple[int, dict]:
    body = {"prompt": "the capital of France", "max_tokens": 8, "ignore_eos": True, **extra}
    async with http.post(daemon.url + COMPLETIONS, json=body) as r:
        return r.status, await r.json()


async def test_a_tiny_temperature_over_http_on_torch_is_greedy(torch_daemon, http):
    status, tiny = await completion(http, torch_daemon, temperature=1e-40)
    assert status == 200, tiny
    assert (await completion(http, torch_daemon, temperature=0))[1]["choices"][0]["text"] == tiny["choices"][0]["text"]


async def test_seeds_over_http(torch_daemon, http):
    for seed in (-1, 2**63, 2**64 - 1):
        status, body = await completion(http, torch_daemon, temperature=1.0, seed=seed)
        assert status == 200, body
    for seed in (2**64, -2**63 - 1):
        for url, body in ((COMPLETIONS, {"prompt": "hi", "max_tokens": 2}), (CHAT, chat_body(max_tokens=2))):
            async with http.post(torch_daemon.url + url, json={**body, "seed": seed}) as r:
                assert r.status == 400
                error = (await r.json())["error"]
            assert (error["code"], error["param"]) == ("invalid_value", "seed")
