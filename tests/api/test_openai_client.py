"""The official openai client against the daemon: chat (streaming and not) and completions."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, NotFoundError

from http_daemon import serving


@pytest.fixture
async def client(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), api_key=["k"], served_model_name=["tiny"]) as d:
        client = AsyncOpenAI(base_url=d.url + "/v1", api_key="k", max_retries=0)
        yield client
        await client.close()


MESSAGES = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "the capital of France"}]


async def test_chat(client):
    reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.model == "tiny"
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens == 5 and reply.usage.prompt_tokens_details.cached_tokens == 0

    stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5


async def test_max_completion_tokens_and_unknown_fields(client):
    reply = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=3,
                                                 temperature=0, user="someone", metadata={"k": "v"}, store=False,
                                                 parallel_tool_calls=False, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3


async def test_completions(client):
    reply = await client.completions.create(model="tiny", prompt="the capital of France is", max_tokens=4,
                                            temperature=0, logprobs=1, extra_body={"ignore_eos": True})
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 4
    assert len(reply.choices[0].logprobs.tokens) == 4
    stream = await client.completions.create(model="tiny", prompt="the capital of France is", max_tokens=4,
                                             temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert "".join([c.choices[0].text async for c in stream]) == reply.choices[0].text


async def test_errors_surface_as_the_clients_exceptions(client):
    with pytest.raises(NotFoundError) as e:
        await client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.code == "model_not_found"
