"""POST /v1/responses: the official `openai` client and the `openai-agents` SDK on the scripted agent
daemon (tests/agent_server.py), the same prompt tokens as chat, and warm resume on a tiny real model."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from agent_server import WEATHER, agent_model, reply, user  # noqa: F401 (fixtures)
from http_daemon import serving, sse_events
from scripted_replies import recording

FUNCTION = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool
CALL_ITEM = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.fixture
async def served(agent_model):
    backend, script = recording(agent_model, reply)
    async with serving(agent_model, backend, served_model_name=["tiny"], max_stored_responses=3) as d:
        yield d, script, backend


@pytest.fixture
def oai(served, sdk):
    return sdk.openai(served[0])


async def test_text_and_reasoning_non_streaming(oai):
    done = await oai.responses.create(model="tiny", input="think first")
    assert done.status == "completed" and done.object == "response"
    kinds = [item.type for item in done.output]
    assert kinds == ["reasoning", "message"]
    assert done.output[0].content[0].text == "The user wants a greeting."
    assert done.output_text == "Hello there!"
    assert done.usage.output_tokens > 0 and done.usage.input_tokens_details.cached_tokens == 0


async def test_streaming_event_sequence_accumulates_to_the_response(oai):
    types, sequence = [], []
    async with oai.responses.stream(model="tiny", input="weather?", tools=[FUNCTION]) as stream:
        async for event in stream:
            types.append(event.type)
            sequence.append(event.sequence_number)
        final = await stream.get_final_response()
    assert sequence == list(range(len(types)))
    text_deltas = types.count("response.output_text.delta")
    args_deltas = types.count("response.function_call_arguments.delta")
    assert text_deltas >= 1 and args_deltas >= 1
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    message, call = final.output
    assert message.content[0].text == "Let me check."
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert call.call_id.startswith("call_") and call.status == "completed"


async def test_function_call_round_trip_through_previous_response_id(oai):
    first = await oai.responses.create(model="tiny", input="weather?", tools=[FUNCTION])
    (call,) = [item for item in first.output if item.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = await oai.responses.create(model="tiny", previous_response_id=first.id, input=[result],
                                        tools=[FUNCTION])
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    # the same turn sent as the whole history, streaming
    history = [{"role": "user", "content": "weather?"}] + [item.model_dump(exclude_none=True) for item in first.output]
    stream = await oai.responses.create(model="tiny", input=history + [result], tools=[FUNCTION], stream=True)
    text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    assert text == "It is sunny in Paris."


async def test_named_tool_choice_and_max_output_tokens(oai):
    forced = await oai.responses.create(model="tiny", input="forced", tools=[FUNCTION],
                                        tool_choice={"type": "function", "name": "get_weather"})
    assert [item.type for item in forced.output] == ["function_call"]
    cut = await oai.responses.create(model="tiny", input="say stop", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 2


async def test_the_same_prompt_tokens_as_the_chat_twin(served, oai, sdk):
    daemon, script, _ = served
    chat = sdk.openai(daemon)
    twin = await chat.chat.completions.create(model="tiny", max_tokens=1, tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Look it up.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])
    via_chat = script.prompt(twin.usage.prompt_tokens)
    done = await oai.responses.create(model="tiny", max_output_tokens=1, tools=[FUNCTION], instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        CALL_ITEM,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ])
    assert done.usage.input_tokens == twin.usage.prompt_tokens and script.prompt(done.usage.input_tokens) == via_chat


async def test_store_false_the_cap_retrieve_and_delete(oai):
    unstored = await oai.responses.create(model="tiny", input="hello", store=False)
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.responses.create(model="tiny", input="again", previous_response_id=unstored.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    kept = [await oai.responses.create(model="tiny", input=f"turn {i}") for i in range(4)]  # the cap is 3
    with pytest.raises(openai.NotFoundError):
        await oai.responses.create(model="tiny", input="next", previous_response_id=kept[0].id)
    later = await oai.responses.create(model="tiny", input="next", previous_response_id=kept[-1].id)
    assert later.status == "completed"
    assert (await oai.responses.retrieve(later.id)).model_dump() == later.model_dump()
    await oai.responses.delete(later.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await oai.responses.retrieve(later.id)
    assert caught.value.body["code"] == "response_not_found"


async def test_bad_input_is_a_400_naming_the_field(oai):
    cases = [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [FUNCTION]}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            await oai.responses.create(model="tiny", **body)
        assert caught.value.body["param"] == param, body


async def test_openai_agents_sdk_round_trip(served, sdk):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return "sunny"

    client = sdk.openai(served[0])
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
    agent = agents.Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model)
    result = await agents.Runner.run(agent, "weather?")
    assert calls == ["Paris"] and result.final_output == "It is sunny in Paris."
    streamed = agents.Runner.run_streamed(agent, "weather?")
    async for _ in streamed.stream_events():
        pass
    assert calls == ["Paris", "Paris"] and streamed.final_output == "It is sunny in Paris."
    # chained by the server: each request after the first sends only its new items
    chained = await agents.Runner.run(agent, "weather?", auto_previous_response_id=True)
    assert calls == ["Paris"] * 3 and chained.final_output == "It is sunny in Paris."
    follow = await agents.Runner.run(agent, "say stop", previous_response_id=chained.last_response_id)
    assert follow.final_output == "one two STOP three"


LONG = "the capital of France is a city where many people live and work every day " * 4


async def test_previous_response_id_resumes_warm_and_branches_fall_back_to_the_prefix_cache(agent_model):
    pytest.importorskip("mlx.core")
    async with (serving(agent_model, served_model_name=["tiny"]) as daemon,
                openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as client):
        def turn(text: str, previous=None):
            return client.responses.create(model="tiny", input=text, max_output_tokens=3, temperature=0,
                                           previous_response_id=previous)

        first = await turn(LONG)
        opens = await turn("and the next city", first.id)  # the first continuation opens the session
        warm = await turn("and the one after", opens.id)
        assert warm.usage.input_tokens_details.cached_tokens >= opens.usage.input_tokens + opens.usage.output_tokens - 1
        # two more continuations of `opens`, at once: its session has moved on, so both run
        # without it and read `opens`' prompt from the prefix cache
        branches = await asyncio.gather(*[turn(f"branch {i}", opens.id) for i in range(2)])
        for branch in branches:
            assert branch.status == "incomplete" and branch.usage.output_tokens == 3  # a whole answer, cut at 3
            assert branch.usage.input_tokens_details.cached_tokens >= opens.usage.input_tokens - 1
        # the conversation's own line is still warm
        on = await turn("and then", warm.id)
        assert on.usage.input_tokens_details.cached_tokens >= warm.usage.input_tokens


async def test_a_failure_mid_stream_is_an_error_event(served):
    daemon, _, backend = served
    backend.fail = lambda kind, sessions, inputs: kind == "decode" and any(len(s.tokens) > 60 for s in sessions)
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "input": "go on", "stream": True, "max_output_tokens": 500}
        async with http.post(daemon.url + "/v1/responses", json=body) as r:
            assert r.status == 200
            lines = await sse_events(r)
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] == "error"
    error = json.loads(lines[-1].removeprefix("data: "))
    assert error["type"] == "error" and error["code"] == "engine_error" and error["sequence_number"] == len(events) - 1
    assert "[DONE]" not in "".join(lines)
