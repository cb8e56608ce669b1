"""n > 1 through the official openai client: choices reproducible by seed, the prompt computed once,
streams tagged by index, a failing choice failing alone, a disconnect freeing every choice, --max-n."""

from __future__ import annotations

import aiohttp
import pytest
from http_daemon import chat_body, metrics, serving, until
from openai import BadRequestError
from scripted_backend import ScriptedBackend

from kvfork.backends import create_backend

MESSAGES = [{"role": "user", "content": "the capital of France"}]
PREFILLED = "kvfork_prefilled_tokens_total"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(params=["mlx", "torch"])
async def daemon(request, tiny_model_dir):
    # no prefix cache: every request computes its prompt, so the prefill counter counts it
    async with serving(tiny_model_dir("llama"), create_backend(request.param), accept_any_model=True,
                       engine=dict(prefix_cache_entries=0)) as d:
        yield d


async def test_seeded_choices_are_reproducible_and_choice_0_is_the_single_answer(daemon, http, sdk):
    client = sdk.openai(daemon)
    ask = dict(model="x", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7, extra_body=NO_EOS)
    before = (await metrics(http, daemon.url))[PREFILLED]
    first = await client.chat.completions.create(n=3, **ask)
    after = (await metrics(http, daemon.url))[PREFILLED]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert after - before == first.usage.prompt_tokens  # the prompt computed once, not three times
    assert first.usage.completion_tokens == 36 and first.usage.total_tokens == first.usage.prompt_tokens + 36
    texts = [c.message.content for c in first.choices]
    again = await client.chat.completions.create(n=3, **ask)
    assert [c.message.content for c in again.choices] == texts
    single = await client.chat.completions.create(n=1, **ask)
    assert single.choices[0].message.content == texts[0]
    # each choice samples its own stream (the tiny model is peaked: a hot temperature shows it)
    hot = await client.completions.create(model="x", prompt="the capital of France", n=3, max_tokens=16,
                                          temperature=2.0, seed=7, extra_body=NO_EOS)
    assert len({c.text for c in hot.choices}) > 1
    await client.close()


async def test_greedy_choices_are_the_single_answer(daemon, sdk):
    client = sdk.openai(daemon)
    ask = dict(model="x", messages=MESSAGES, max_tokens=10, temperature=0, extra_body=NO_EOS)
    pair = await client.chat.completions.create(n=2, **ask)
    single = await client.chat.completions.create(**ask)
    assert [c.message.content for c in pair.choices] == [single.choices[0].message.content] * 2
    completions = await client.completions.create(model="x", prompt="the capital of France is", n=2, max_tokens=6,
                                                  temperature=0, extra_body=NO_EOS)
    alone = await client.completions.create(model="x", prompt="the capital of France is", max_tokens=6,
                                            temperature=0, extra_body=NO_EOS)
    assert [c.index for c in completions.choices] == [0, 1]
    assert [c.text for c in completions.choices] == [alone.choices[0].text] * 2
    assert completions.usage.completion_tokens == 12
    await client.close()


async def test_streamed_choices_carry_their_index(daemon, sdk):
    client = sdk.openai(daemon)
    ask = dict(model="x", messages=MESSAGES, max_tokens=8, temperature=1.0, seed=3, n=3, extra_body=NO_EOS)
    whole = await client.chat.completions.create(**ask)
    stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask)
    chunks = [c async for c in stream]
    texts, roles, finishes = ["", "", ""], [0, 0, 0], [None, None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert roles == [1, 1, 1] and finishes == ["length"] * 3
    assert texts == [c.message.content for c in whole.choices]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24  # the usage once, at the end
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    completions = await client.completions.create(model="x", prompt="the capital", n=2, max_tokens=5, seed=3,
                                                  temperature=1.0, stream=True, extra_body=NO_EOS)
    streamed = ["", ""]
    async for chunk in completions:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    whole_completion = await client.completions.create(model="x", prompt="the capital", n=2, max_tokens=5, seed=3,
                                                       temperature=1.0, extra_body=NO_EOS)
    assert streamed == [c.text for c in whole_completion.choices]
    await client.close()


async def test_n_over_max_n_is_a_400(tiny_model_dir, sdk):
    async with serving(tiny_model_dir("llama"), max_n=2, accept_any_model=True) as d:
        client = sdk.openai(d)
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(model="x", messages=MESSAGES, n=3)
        assert e.value.code == "integer_above_max_value" and e.value.param == "n"
        reply = await client.chat.completions.create(model="x", messages=MESSAGES, n=2, max_tokens=2)
        assert len(reply.choices) == 2
        await client.close()


async def test_a_failing_choice_fails_alone(tiny_model_dir, sdk):
    backend = ScriptedBackend()
    backend.sample_fail = lambda state: state.params.seed == 6 and len(state.output) == 2
    async with serving(tiny_model_dir("llama"), backend, accept_any_model=True) as d:
        client = sdk.openai(d)
        ask = dict(model="x", messages=MESSAGES, max_tokens=5, temperature=1.0, seed=5, n=3, extra_body=NO_EOS)
        reply = await client.chat.completions.create(**ask)
        assert [c.finish_reason for c in reply.choices] == ["length", "error", "length"]
        assert reply.usage.completion_tokens == 5 + 2 + 5
        stream = await client.chat.completions.create(stream=True, **ask)
        finishes = {c.choices[0].index: c.choices[0].finish_reason async for c in stream if c.choices[0].finish_reason}
        assert finishes == {0: "length", 1: "error", 2: "length"}
        await client.close()


async def test_a_disconnect_cancels_every_choice(tiny_model_dir, http):
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.01  # 3000 tokens take far longer than the test lets them run
    async with serving(tiny_model_dir("llama"), backend, engine=dict(inference_slots=3)) as d:
        read = lambda: metrics(http, d.url)  # noqa: E731
        async with aiohttp.ClientSession() as client:
            body = chat_body(max_tokens=3000, ignore_eos=True, stream=True, n=3)
            response = await client.post(d.url + "/v1/chat/completions", json=body)
            async for line in response.content:
                if b'"content":"' in line and b'"role"' not in line:
                    break
            assert (await read())["kvfork_running_requests"] == 3
            response.close()
        await until(read, lambda m: m.get('kvfork_requests_total{finish_reason="cancelled"}') == 3
                    and m["kvfork_running_requests"] == 0, "every choice cancelled")
        stored = d.state.engine.stats().cached
        await until(read, lambda m: m["kvfork_live_sessions"] == stored and m["kvfork_kv_reserved_bytes"] == 0,
                    "every session released")
        assert backend.live_sessions() == stored
