"""The Anthropic Messages API over HTTP with the official `anthropic` client: replies, streams,
tool use, thinking, errors, keys and names, and the same prompt as chat completions."""

from __future__ import annotations

import json
import random

import aiohttp
import anthropic
import pytest

from agent_server import CLAUDE_TOOL, WEATHER, agent_model, claude, daemon, oai, reply, user  # noqa: F401
from http_daemon import metrics, serving, until
from scripted_replies import scripted


async def test_messages_tool_use_non_streaming(claude):
    message = await claude.messages.create(model="tiny", max_tokens=200, messages=user("weather?"),
                                           tools=[CLAUDE_TOOL], system="You are helpful.")
    assert message.stop_reason == "tool_use" and message.role == "assistant" and message.model == "tiny"
    text, tool = message.content
    assert (text.type, text.text) == ("text", "Let me check.")
    assert (tool.type, tool.name, tool.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert tool.id.startswith("toolu_")
    assert message.usage.output_tokens > 0 and message.usage.cache_read_input_tokens == 0


async def test_messages_streaming_rebuilds_the_same_message(claude):
    kwargs = dict(model="tiny", max_tokens=200, messages=user("think first"), tools=[CLAUDE_TOOL])
    whole = await claude.messages.create(**kwargs)
    kinds = []
    async with claude.messages.stream(**kwargs) as stream:
        async for event in stream:
            kinds.append(event.type)
        streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "The user wants a greeting."
    assert streamed.stop_reason == whole.stop_reason == "end_turn"
    assert streamed.usage.output_tokens == whole.usage.output_tokens


async def test_messages_thinking_setting_reaches_the_template(claude):
    kwargs = dict(model="tiny", messages=user("think first"))
    plain = await claude.messages.count_tokens(**kwargs)
    enabled = await claude.messages.count_tokens(thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
    disabled = await claude.messages.count_tokens(thinking={"type": "disabled"}, **kwargs)
    assert plain.input_tokens < enabled.input_tokens < disabled.input_tokens  # <think>\n, then a closed block
    message = await claude.messages.create(max_tokens=100, thinking={"type": "enabled", "budget_tokens": 1024},
                                           **kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "The user wants a greeting."), ("text", "Hello there!")]


async def test_messages_stop_sequence_and_max_tokens(claude):
    stopped = await claude.messages.create(model="tiny", max_tokens=200, messages=user("say stop"),
                                           stop_sequences=["STOP"])
    assert (stopped.stop_reason, stopped.stop_sequence, stopped.content[0].text) == ("stop_sequence", "STOP", "one two ")
    cut = await claude.messages.create(model="tiny", max_tokens=2, messages=user("say stop"))
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


async def test_messages_tool_result_round_trip_reads_the_cache(claude):
    first = await claude.messages.create(model="tiny", max_tokens=200, messages=user("weather?"), tools=[CLAUDE_TOOL])
    tool = first.content[1]
    history = user("weather?") + [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id, "content": "sunny",
                                      "cache_control": {"type": "ephemeral"}}]},
    ]
    second = await claude.messages.create(model="tiny", max_tokens=200, messages=history, tools=[CLAUDE_TOOL])
    assert second.content[0].text == "It is sunny in Paris." and second.stop_reason == "end_turn"
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 1


async def test_history_through_either_api_is_the_same_prompt(oai, claude):
    """The OpenAI twin of an Anthropic history: same token count, and the second is served from the first's cache."""
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    anthropic_history = user("weather?") + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}, tool_use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    openai_history = user("weather?") + [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    counted = await claude.messages.count_tokens(model="tiny", messages=anthropic_history, tools=[CLAUDE_TOOL],
                                                 system="Be brief.")
    done = await oai.chat.completions.create(model="tiny", tools=[WEATHER],
                                             messages=[{"role": "system", "content": "Be brief."}] + openai_history)
    assert counted.input_tokens == done.usage.prompt_tokens
    again = await claude.messages.create(model="tiny", max_tokens=50, messages=anthropic_history,
                                         tools=[CLAUDE_TOOL], system="Be brief.")
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == done.usage.prompt_tokens
    assert again.usage.cache_read_input_tokens == done.usage.prompt_tokens - 1
    assert again.content[0].text == done.choices[0].message.content == "It is sunny in Paris."


# --- Anthropic errors, keys and names -------------------------------------------------------------


async def test_messages_errors_use_anthropic_shape(daemon, claude, sdk):
    with pytest.raises(anthropic.NotFoundError) as caught:
        await claude.messages.create(model="my-agent-model", max_tokens=5, messages=user("hi"))
    assert caught.value.body == {"type": "error", "error": {"type": "not_found_error", "message": caught.value.body["error"]["message"]}}
    assert "my-agent-model" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        await claude.messages.create(model="tiny", max_tokens=0, messages=user("hi"))
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in caught.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="'tiny' reads text only"):
        await claude.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [image]}])
    wrong = sdk.anthropic(daemon, api_key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await wrong.messages.create(model="tiny", max_tokens=5, messages=user("hi"))
    assert caught.value.body["error"]["type"] == "authentication_error"


async def test_messages_bearer_key_and_error_mid_stream(daemon, sdk):
    bearer = sdk.anthropic(daemon, api_key=None, auth_token="sekrit")
    message = await bearer.messages.create(model="tiny", max_tokens=20, messages=user("hi"))
    assert message.content[0].text == "Plain answer."
    daemon.engine.backend.fail = lambda kind, sessions, inputs: kind == "decode"
    with pytest.raises(anthropic.APIStatusError) as caught:
        async with bearer.messages.stream(model="tiny", max_tokens=20, messages=user("hi")) as stream:
            async for _ in stream:
                pass
    assert caught.value.body["type"] == "error" and "generation failed" in caught.value.body["error"]["message"]


async def test_messages_stream_hang_up_cancels_the_request(daemon):
    daemon.engine.backend.delay["decode"] = 0.002
    headers = {"x-api-key": "sekrit"}
    body = {"model": "tiny", "max_tokens": 3000, "messages": user("go on"), "stream": True}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with aiohttp.ClientSession(headers=headers) as client:
            response = await client.post(daemon.url + "/v1/messages", json=body)
            async for line in response.content:
                if line.startswith(b"event: content_block_delta"):
                    break
            response.close()  # the client goes away mid-stream
        cancelled = 'kvfork_requests_total{finish_reason="cancelled"}'
        seen = await until(lambda: metrics(http, daemon.url), lambda m: m.get(cancelled) == 1, "the stream cancelled")
        assert seen["kvfork_generated_tokens_total"] < 3000
        assert seen['kvfork_http_requests_total{route="/v1/messages",status="499"}'] == 1


async def test_messages_no_input_yields_a_500(daemon):
    rng = random.Random(0)
    values = [None, True, -1, 0, 1.5, "", "x", [], [1, "a"], {}, {"type": "x"}, [{"type": "text"}],
              [{"type": "tool_result"}], [{"type": "tool_use", "id": "a", "name": "b", "input": 1}]]
    fields = ["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "temperature",
              "top_p", "top_k", "stream", "metadata", "thinking"]
    good = {"model": "tiny", "max_tokens": 1, "messages": user("hi")}
    bodies = [b"null", b"[]", b"{" * 5000, b'{"messages": 1}']
    for _ in range(120):
        body = dict(good)
        for field in rng.sample(fields, rng.randint(1, 3)):
            body[field] = rng.choice(values)
        if rng.random() < 0.4:
            body["messages"] = [{"role": rng.choice(["user", "assistant", "x"]), "content": rng.choice(values)}]
        bodies.append(json.dumps(body).encode())
    async with aiohttp.ClientSession(headers={"x-api-key": "sekrit"}) as http:
        for route in ("/v1/messages", "/v1/messages/count_tokens"):
            for data in bodies:
                async with http.post(daemon.url + route, data=data) as r:
                    body = await r.json(content_type=None) if r.status >= 400 else None
                    assert r.status < 500, (data[:200], body)
                    if body is not None:
                        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}


async def test_messages_accept_any_model(agent_model, sdk):
    async with serving(agent_model, scripted(agent_model, reply), accept_any_model=True) as d:
        client = sdk.anthropic(d)
        message = await client.messages.create(model="my-agent-model", max_tokens=20, messages=user("hi"))
        assert message.model == "my-agent-model" and message.content[0].text == "Plain answer."
