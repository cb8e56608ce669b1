"""Tool calls and reasoning in chat completions, over HTTP with the official `openai` client."""

from __future__ import annotations

import json

import openai
import pytest

from agent_server import CLAUDE_TOOL, REPLIES, WEATHER, agent_model, daemon, oai, reply, user  # noqa: F401 (fixtures)
from http_daemon import serving
from scripted_replies import recording, scripted
from kvfork.server.api.sse import EventStream
from kvfork.server.cli import serve_parser
from kvfork.server.common.config import ServerConfig
from kvfork.server.settings import from_args
from kvfork.server.generate import chat_output


async def test_chat_tool_call_non_streaming(oai):
    done = await oai.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


async def test_chat_tool_calls_streaming_deltas(oai):
    stream = await oai.chat.completions.create(model="tiny", messages=user("two calls"), tools=[WEATHER], stream=True)
    content, calls, finish = "", {}, None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.index not in calls:  # the first delta of a call carries its id and name
                assert d.id and d.type == "function" and d.function.name == "get_weather"
                calls[d.index] = ""
            else:
                assert d.id is None and d.function.name is None
            calls[d.index] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "" and finish == "tool_calls"
    assert [json.loads(a) for a in calls.values()] == [{"city": "Paris"}, {"city": "Oslo"}]


async def test_the_model_s_formats_are_resolved_once_at_its_load(daemon, oai, monkeypatch):
    """The tool-call family and the reasoning format depend on the template and vocabulary alone: resolved when
    the model loads, then read by every request, never resolved again."""
    formats = daemon.state.formats
    assert formats == chat_output.ModelFormats("hermes", "think")
    resolved: list[tuple] = []
    monkeypatch.setattr(chat_output, "resolve_tool_parser", lambda *given: resolved.append(given))
    monkeypatch.setattr(chat_output, "resolve_reasoning", lambda *given: resolved.append(given))
    done = await oai.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER])
    assert done.choices[0].message.tool_calls
    stream = await oai.chat.completions.create(model="tiny", messages=user("two calls"), tools=[WEATHER],
                                               stream=True)
    assert [chunk async for chunk in stream]
    assert resolved == [] and daemon.state.formats is formats


async def test_tool_result_round_trip(oai):
    first = await oai.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER])
    message = first.choices[0].message
    history = user("weather?") + [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"},
    ]
    second = await oai.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
    # the resent history shares the first prompt: it is read from the prefix cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


async def test_reasoning_content_split_streaming_and_not(oai):
    done = await oai.chat.completions.create(model="tiny", messages=user("think first"))
    assert done.choices[0].message.reasoning_content == "The user wants a greeting."
    assert done.choices[0].message.content == "Hello there!"
    stream = await oai.chat.completions.create(model="tiny", messages=user("think first"), stream=True)
    reasoning, content = "", ""
    async for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("The user wants a greeting.", "Hello there!")


async def test_enable_thinking_reaches_the_template_and_the_split_follows(oai):
    """true: the prompt opens <think>, the reply starts inside it; false: the prompt closes an empty one."""
    opened = await oai.chat.completions.create(model="tiny", messages=user("think first"),
                                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert opened.choices[0].message.reasoning_content == "The user wants a greeting."
    assert opened.choices[0].message.content == "Hello there!"
    stream = await oai.chat.completions.create(model="tiny", messages=user("think first"), stream=True,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    reasoning = "".join([getattr(c.choices[0].delta, "reasoning_content", None) or "" async for c in stream])
    assert reasoning == "The user wants a greeting."
    closed = await oai.chat.completions.create(model="tiny", messages=user("no think"),
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert closed.choices[0].message.content == "No thinking."
    assert getattr(closed.choices[0].message, "reasoning_content", None) is None


async def test_tool_choice_none_leaves_markup_as_text(oai):
    done = await oai.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER],
                                             tool_choice="none")
    assert done.choices[0].message.content == REPLIES["weather?"]
    assert done.choices[0].message.tool_calls is None and done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_required_and_named_tool_choice_force_a_call(oai, choice):
    auto = await oai.chat.completions.create(model="tiny", messages=user("forced"), tools=[WEATHER])
    forced = await oai.chat.completions.create(model="tiny", messages=user("forced"), tools=[WEATHER],
                                               tool_choice=choice)
    # the prompt ends with the opening markup, so the reply continues inside the call
    assert forced.usage.prompt_tokens > auto.usage.prompt_tokens
    (call,) = forced.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}


async def test_a_forced_call_the_model_would_botch_is_held_to_the_schema(oai):
    """The scripted model wants `{not json}` inside the forced call; the grammar lets only the call's JSON
    through, so the reply stays inside a valid call until max_tokens, and the partial text comes back."""
    done = await oai.chat.completions.create(model="tiny", messages=user("forced broken"), tools=[WEATHER],
                                             tool_choice="required", max_tokens=48)
    choice = done.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
    assert "not json" not in choice.message.content


@pytest.mark.parametrize(
    "choice, tools, param",
    [
        ({"type": "function", "function": {"name": "nope"}}, [WEATHER], "tool_choice"),
        ("required", None, "tool_choice"),
        ("sometimes", [WEATHER], "tool_choice"),
        ("auto", [{"type": "function"}], "tools[0]"),
    ],
)
async def test_bad_tools_and_tool_choice_are_400(oai, choice, tools, param):
    extra = {"tools": tools} if tools else {}
    with pytest.raises(openai.BadRequestError) as caught:
        await oai.chat.completions.create(model="tiny", messages=user("x"), tool_choice=choice, **extra)
    assert caught.value.body["param"] == param


async def test_a_held_call_gets_keep_alives_and_a_busy_stream_does_not():
    """A long call sends nothing until it closes: the stream writes a keep-alive once it has been quiet."""
    class Response:
        def __init__(self):
            self.frames = []

        async def write(self, frame):
            self.frames.append(frame)

    stream = EventStream({})  # type: ignore[arg-type]  (a request is a mapping; this one opened no stream early)
    stream.response, stream.last_write = Response(), 0.0
    await stream.keep_alive_if_quiet(5.0)  # quiet since long ago
    await stream.keep_alive_if_quiet(5.0)  # it just wrote
    assert stream.response.frames == [b": keep-alive\n\n"]


async def test_tool_parser_setting_overrides_the_template(agent_model, sdk):
    async with serving(agent_model, scripted(agent_model, reply), tool_parser="none",
                       served_model_name=["tiny"]) as d:
        client = sdk.openai(d)
        done = await client.chat.completions.create(messages=user("weather?"), tools=[WEATHER], model="tiny")
        assert done.choices[0].message.content == REPLIES["weather?"] and not done.choices[0].message.tool_calls


def test_tool_parser_flag():
    args = serve_parser().parse_args(["--tool-parser", "qwen3_coder", "--reasoning-parser", "none"])
    config = from_args(ServerConfig, args)
    assert (config.tool_parser, config.reasoning_parser) == ("qwen3_coder", "none")
    assert from_args(ServerConfig, serve_parser().parse_args([])).tool_parser == "auto"
    with pytest.raises(SystemExit) as caught:
        serve_parser().parse_args(["--tool-parser", "xml"])
    assert caught.value.code == 2


async def test_a_template_without_tools_gets_the_hermes_block(tiny_model_dir, sdk):
    """The tiny model's ChatML template renders no tools (as SmolLM2's): the tools go into a system
    block in Hermes' words, past calls and results are written as Hermes markup, replies parse as
    Hermes calls, and tool_choice is kept (through /v1/messages too)."""
    model = tiny_model_dir("llama")
    backend, script = recording(model, reply)
    async with (serving(model, backend, served_model_name=["tiny"]) as d,
                openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0) as client):
        plain = await client.chat.completions.create(model="tiny", messages=user("weather?"), max_tokens=1)
        assert "<tools>" not in script.prompt_text(plain.usage.prompt_tokens)
        done = await client.chat.completions.create(model="tiny", messages=user("weather?"), tools=[WEATHER])
        (call,) = done.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert done.choices[0].message.content == "Let me check." and done.usage.prompt_tokens > plain.usage.prompt_tokens
        forced = await client.chat.completions.create(model="tiny", messages=user("forced"), tools=[WEATHER],
                                                      tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
        assert forced.choices[0].finish_reason == "tool_calls"
        assert script.prompt_text(forced.usage.prompt_tokens).endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
        history = user("weather?") + [done.choices[0].message.model_dump(exclude_none=True),
                                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        second = await client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER])
        assert second.choices[0].message.content == "It is sunny in Paris."
        text = script.prompt_text(second.usage.prompt_tokens)
        claude = sdk.anthropic(d)
        used = await claude.messages.create(model="tiny", max_tokens=100, messages=user("forced"), tools=[CLAUDE_TOOL],
                                            tool_choice={"type": "tool", "name": "get_weather"})
        assert [(b.type, b.name, b.input) for b in used.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    tools_json = json.dumps(WEATHER, ensure_ascii=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and f"<tools>\n{tools_json}\n</tools>" in text
    assert ('<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
