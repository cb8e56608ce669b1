"""Constrained output over HTTP, with the official clients, on a tiny random model: whatever the
weights say, response_format and tool_choice hold, on chat completions and /v1/messages."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from http_daemon import serving

FORECAST = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}},
         {"type": "function", "function": {"name": "get_alerts", "parameters": {
             "type": "object", "properties": {"severe": {"type": "boolean"}}, "required": ["severe"]}}}]
ASK = [{"role": "user", "content": "the forecast"}]


@pytest.fixture
async def daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), tool_parser="hermes", served_model_name=["tiny"]) as d:
        yield d


@pytest.fixture
def oai(daemon, sdk):
    return sdk.openai(daemon, api_key="none")


async def test_json_schema_response_format(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
    for seed in range(2):
        done = await oai.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=48,
                                                 temperature=1.0, seed=seed)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), FORECAST)


async def test_bad_response_formats_are_400s_naming_the_problem(oai):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "frob"}}}, "strict": True}}
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny", messages=ASK, response_format=bad)
    assert "frob" in e.value.message and e.value.code == "invalid_grammar"
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        await oai.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format.type"


@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_tool_choice_in_chat(oai, stream):
    for choice, names in [({"type": "function", "function": {"name": "get_forecast"}}, {"get_forecast"}),
                          ("required", {"get_forecast", "get_alerts"})]:
        kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=96, temperature=0)
        if stream:
            calls, finish = {}, None
            async for chunk in await oai.chat.completions.create(stream=True, **kwargs):
                for d in chunk.choices[0].delta.tool_calls or ():
                    calls.setdefault(d.index, ["", ""])
                    calls[d.index][0] += d.function.name or ""
                    calls[d.index][1] += d.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            pairs = list(calls.values())
        else:
            done = await oai.chat.completions.create(**kwargs)
            finish = done.choices[0].finish_reason
            pairs = [(c.function.name, c.function.arguments) for c in done.choices[0].message.tool_calls or ()]
        # a named choice is one call, then the end; `required` may go on calling until max_tokens
        assert pairs and finish == ("tool_calls" if len(names) == 1 else finish)
        assert finish in ("tool_calls", "length")
        for name, arguments in pairs:
            assert name in names
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
            jsonschema.validate(json.loads(arguments), schema)


async def test_required_without_parallel_calls_is_one_call(oai):
    done = await oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=96, temperature=0)
    assert done.choices[0].finish_reason == "tool_calls" and len(done.choices[0].message.tool_calls) == 1


async def test_messages_tool_choice_tool_yields_a_valid_tool_use(daemon, sdk):
    claude = sdk.anthropic(daemon, api_key="none")
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    message = await claude.messages.create(model="tiny", max_tokens=96, messages=ASK, tools=tools,
                                           tool_choice={"type": "tool", "name": "get_forecast"})
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and [u.name for u in uses] == ["get_forecast"]
    jsonschema.validate(uses[0].input, FORECAST)


@pytest.mark.default_model
async def test_json_schema_on_the_default_model(sdk):
    from kvfork.backends import create_backend
    from kvfork.backends import default_model

    folder = str(default_model.ensure_default_model())
    async with serving(folder, create_backend("torch"), served_model_name=["smol"]) as d:
        client = sdk.openai(d, api_key="none")
        fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST, "strict": True}}
        done = await client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Forecast for Paris, 3 days, in celsius, as JSON."}],
            response_format=fmt, max_tokens=48, temperature=0)
        assert done.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(done.choices[0].message.content), FORECAST)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_grammar_past_llguidance_limits_while_generating_is_the_requests_error(oai, stream):
    """600 optional properties compile in time, but after `{` a parser row holds ~2,400 items, past
    llguidance's max_items_in_row (server/generate/grammar.py PARSER_LIMITS): the request's own grammar ended it,
    so it is invalid_grammar, a 400 (an error event once a stream has begun), never a server error
    that a client would retry."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
    if not stream:
        with pytest.raises(openai.BadRequestError) as e:
            await oai.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, max_tokens=8)
        assert e.value.code == "invalid_grammar" and "max is" in e.value.message
        return
    with pytest.raises(openai.APIError) as e:
        async for _ in await oai.chat.completions.create(model="tiny", messages=ASK, response_format=fmt,
                                                         max_tokens=8, stream=True):
            pass
    assert e.value.code == "invalid_grammar" and "max is" in e.value.message
