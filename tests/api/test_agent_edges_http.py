"""What real agent clients hit first (issue 23), over HTTP with the official clients where they apply:
a system message inside /v1/messages, opt-in named sessions that never refuse, the output limit
left to the context, Anthropic's context wording and usage split, Codex's namespace tools, HEAD /."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import aiohttp
import pytest

from agent_server import CLAUDE_TOOL, agent_model, claude, daemon, oai, reply, user  # noqa: F401
from http_daemon import serving, sse_events
from scripted_replies import RecordingScript, scripted
from scripted_backend import ScriptedBackend

KEY = {"Authorization": "Bearer sekrit"}
# Qwen3.5's and Gemma's templates raise on a system message that is not first.
STRICT_SYSTEM = ("{%- for m in messages -%}{%- if m.role == 'system' and not loop.first -%}"
                 "{{ raise_exception('System message must be at the beginning.') }}{%- endif -%}{%- endfor -%}")


def strict_model(agent_folder: str, folder: Path) -> str:
    """The agent model with a template that refuses a system message anywhere but first."""
    shutil.copytree(agent_folder, folder, dirs_exist_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = STRICT_SYSTEM + config["chat_template"]
    config_path.write_text(json.dumps(config))
    return str(folder)


def recording(model: str) -> tuple[ScriptedBackend, RecordingScript]:
    from transformers import AutoTokenizer

    script = RecordingScript(AutoTokenizer.from_pretrained(model), reply)
    return ScriptedBackend(script=script), script


MID_SYSTEM = [{"role": "user", "content": "hello"},
              {"role": "system", "content": "Available agent types: general."},
              {"role": "user", "content": "weather?"}]


async def test_a_system_message_inside_messages_is_rendered_in_place(agent_model):
    backend, script = recording(agent_model)
    async with serving(agent_model, backend, served_model_name=["tiny"]) as d, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "max_tokens": 300, "messages": MID_SYSTEM, "tools": [CLAUDE_TOOL]}
        async with http.post(d.url + "/v1/messages", json=body,
                             headers={"anthropic-beta": "mid-conversation-system-2026-04-07"}) as r:
            assert r.status == 200, await r.text()
            message = await r.json()
    assert message["stop_reason"] == "tool_use"
    prompt = script.prompt_text(message["usage"]["input_tokens"])
    assert "<|im_start|>system\nAvailable agent types: general.<|im_end|>" in prompt  # where it stood


async def test_a_template_that_refuses_it_gets_it_merged_into_the_next_user_turn(agent_model, tmp_path):
    model = strict_model(agent_model, tmp_path / "strict")
    backend, script = recording(model)
    async with serving(model, backend, served_model_name=["tiny"]) as d, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "max_tokens": 50, "messages": MID_SYSTEM}
        async with http.post(d.url + "/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
            message = await r.json()
        # the same history through chat completions, with a developer message in the middle
        chat = {"messages": [{"role": "system", "content": "Be brief."}, MID_SYSTEM[0],
                             {"role": "developer", "content": "Mind the units."}, MID_SYSTEM[2]], "max_tokens": 5}
        async with http.post(d.url + "/v1/chat/completions", json=chat) as r:
            assert r.status == 200, await r.text()
            completion = await r.json()
    prompt = script.prompt_text(message["usage"]["input_tokens"])
    assert "<|im_start|>user\n<system>\nAvailable agent types: general.\n</system>\n\nweather?<|im_end|>" in prompt
    assert prompt.count("<|im_start|>system") == 0
    prompt = script.prompt_text(completion["usage"]["prompt_tokens"])
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>user\n<system>\nMind the units.\n</system>\n\nweather?<|im_end|>" in prompt


async def test_a_template_refusal_for_another_reason_is_still_a_400(agent_model, tmp_path):
    folder = tmp_path / "odd"
    shutil.copytree(agent_model, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ raise_exception('Only two messages, please.') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    async with serving(str(folder), ScriptedBackend()) as d, aiohttp.ClientSession() as http:
        async with http.post(d.url + "/v1/messages", json={"max_tokens": 5, "messages": MID_SYSTEM}) as r:
            assert r.status == 400 and "Only two messages" in (await r.json())["error"]["message"]


# ---- named sessions: opt-in, never busy-refused ----

LONG = "the shared long context of an agent " * 12


async def _held(http: aiohttp.ClientSession, url: str, headers: dict, body: dict) -> None:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def test_sessions_are_opt_in_and_a_busy_one_never_refuses(agent_model):
    """opencode sends x-session-id on every request, its title and main requests at once: a
    header kvfork does not own opens no session, and two requests of one session both run."""
    async with serving(agent_model, scripted(agent_model, reply), session_header=["x-opencode-session"]) as d, \
            aiohttp.ClientSession() as http:
        named = d.engine.serving.named
        body = {"messages": [{"role": "user", "content": LONG + "go on"}], "max_tokens": 200}
        await _held(http, d.url, {"X-Session-ID": "ses_1", "x-session-affinity": "ses_1"}, body)
        assert named.get("ses_1") is None and len(named) == 0
        await _held(http, d.url, {"X-Kvfork-Session": "k1"}, body)
        await _held(http, d.url, {"x-opencode-session": "mapped"}, body)
        assert named.get("k1") is not None and named.get("mapped") is not None
        # the same session twice at the same moment: both answer, one of them without the session
        both = [_held(http, d.url, {"X-Kvfork-Session": "k2"}, body) for _ in range(2)]
        await asyncio.gather(*both)
        assert not named.get("k2").busy


def test_session_header_flag():
    from kvfork.server.cli import serve_parser
    from kvfork.server.common.config import ServerConfig
    from kvfork.server.settings import from_args

    args = serve_parser().parse_args(["--session-header", "x-session-id", "--session-header", "x-other"])
    assert from_args(ServerConfig, args).session_header == ["x-session-id", "x-other"]
    with pytest.raises(ValueError, match="--session-header"):
        from_args(ServerConfig, serve_parser().parse_args(["--session-header", "x session"]))


async def test_the_body_session_id_works_on_messages_and_responses(agent_model):
    async with serving(agent_model, scripted(agent_model, reply)) as d, aiohttp.ClientSession() as http:
        named = d.engine.serving.named
        async with http.post(d.url + "/v1/messages", json={"max_tokens": 5, "messages": user("hi"),
                                                           "session_id": "m1"}) as r:
            assert r.status == 200
        async with http.post(d.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 5,
                                                            "session_id": "r1"}) as r:
            assert r.status == 200
        assert named.get("m1") is not None and named.get("r1") is not None


# ---- the output limit, HEAD /, the context error and the usage split ----

async def test_an_omitted_output_limit_runs_to_the_context_left(agent_model):
    async with serving(agent_model, scripted(agent_model, reply), engine=dict(max_context=700)) as d, \
            aiohttp.ClientSession() as http:
        body = {"input": "go on", "stream": False}  # Codex never sends max_output_tokens
        async with http.post(d.url + "/v1/responses", json=body) as r:
            response = await r.json()
        async with http.post(d.url + "/v1/chat/completions", json={"messages": user("go on")}) as r:
            completion = await r.json()
    usage = response["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == 700 and usage["output_tokens"] > 512  # not 512
    assert response["status"] == "incomplete"
    assert completion["usage"]["total_tokens"] == 700


async def test_the_operator_may_still_set_a_default_output_limit(agent_model):
    async with serving(agent_model, scripted(agent_model, reply), engine=dict(max_tokens=7)) as d, \
            aiohttp.ClientSession() as http:
        async with http.post(d.url + "/v1/chat/completions", json={"messages": user("go on")}) as r:
            assert (await r.json())["usage"]["completion_tokens"] == 7


async def test_head_and_get_root_answer(daemon):
    async with aiohttp.ClientSession() as http:
        async with http.head(daemon.url + "/") as r:
            assert r.status == 200
        async with http.get(daemon.url + "/") as r:
            assert r.status == 200


async def test_a_prompt_over_the_context_gets_anthropics_words_on_messages(agent_model):
    async with serving(agent_model, scripted(agent_model, reply), engine=dict(max_context=64)) as d, \
            aiohttp.ClientSession() as http:
        async with http.post(d.url + "/v1/messages", json={"max_tokens": 5, "messages": user(LONG)}) as r:
            assert r.status == 400
            body = await r.json()
        async with http.post(d.url + "/v1/messages/count_tokens", json={"messages": user(LONG)}) as r:
            tokens = (await r.json())["input_tokens"]
        async with http.post(d.url + "/v1/chat/completions", json={"messages": user(LONG)}) as r:
            assert (await r.json())["error"]["code"] == "context_length_exceeded"
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", body["error"]["message"])
    assert body["error"]["message"] == f"prompt is too long: {tokens} tokens > 63 maximum"


async def test_message_start_carries_the_final_usage_split(claude):
    kwargs = dict(model="tiny", max_tokens=50, system=LONG, messages=user("think first"))
    await claude.messages.create(**kwargs)  # now in the prefix cache
    events = []
    async with claude.messages.stream(**kwargs) as stream:
        async for event in stream:
            events.append(event)
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens) == (delta.input_tokens, delta.cache_read_input_tokens)


async def test_before_message_start_keep_alives_are_comments(agent_model):
    backend = scripted(agent_model, reply)
    backend.delay["prefill"] = 0.3  # a long prefill: keep-alives before the first token
    async with serving(agent_model, backend, sse_keepalive=0.05) as d, aiohttp.ClientSession() as http:
        body = {"max_tokens": 5, "messages": user("hello"), "stream": True}
        async with http.post(d.url + "/v1/messages", json=body) as r:
            lines = await sse_events(r)
    first_event = next(i for i, line in enumerate(lines) if line.startswith("event:"))
    assert lines[first_event] == "event: message_start"
    assert any(line.startswith(":") for line in lines[:first_event])


# ---- Codex's tools ----

NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Agents.",
             "tools": [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                        "strict": False,
                        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}}]}


async def test_namespace_tools_are_flattened_and_dropped_tools_are_counted(daemon, oai):
    tools = [NAMESPACE, {"type": "web_search", "external_web_access": False}]
    async with aiohttp.ClientSession() as http:
        body = {"model": "tiny", "input": "weather?", "tools": tools, "store": False}
        async with http.post(daemon.url + "/v1/responses", json=body, headers=KEY) as r:
            assert r.status == 200
            assert r.headers["X-Kvfork-Dropped-Tools"] == "1"  # counted; the log names it
            response = await r.json()
        call = next(item for item in response["output"] if item["type"] == "function_call")
        assert (call["name"], call["namespace"], json.loads(call["arguments"])) == \
            ("get_weather", "multi_agent_v1", {"city": "Paris"})
        # the call goes back in the history with its namespace: the same prompt as a flat function's
        history = [{"role": "user", "content": "weather?"}, {**call, "id": "fc_1"},
                   {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
        flat = [{"type": "function", **{k: v for k, v in NAMESPACE["tools"][0].items() if k != "type"}}]
        for tools_sent in (tools, flat):
            body = {"model": "tiny", "input": history, "tools": tools_sent, "store": False}
            async with http.post(daemon.url + "/v1/responses", json=body, headers=KEY) as r:
                assert r.status == 200
                usage = (await r.json())["usage"]
            body["input"] = history
        assert usage["input_tokens"] > 0
    plain = await oai.responses.create(model="tiny", input="weather?", tools=flat)
    assert plain.output[-1].type == "function_call" and getattr(plain.output[-1], "namespace", None) is None


async def test_a_long_prefill_keeps_a_responses_stream_alive_with_events(agent_model, sdk):
    """Codex drops a stream after 5 minutes without an event (SSE comments do not count): before the
    first output, keep-alives are response.in_progress again; the SDK still assembles the reply."""

    backend = scripted(agent_model, reply)
    backend.delay["prefill"] = 0.3
    async with serving(agent_model, backend, sse_keepalive=0.05, served_model_name=["tiny"]) as d, \
            aiohttp.ClientSession() as http:
        async with http.post(d.url + "/v1/responses", json={"input": "hello", "stream": True}) as r:
            kinds = [json.loads(line[6:])["type"] for line in await sse_events(r) if line.startswith("data: ")]
        client = sdk.openai(d, api_key="x")
        async with client.responses.stream(model="tiny", input="hello") as stream:
            final = await stream.get_final_response()
    first_output = kinds.index("response.output_item.added")
    assert kinds[0] == "response.created" and kinds[1:first_output].count("response.in_progress") >= 2
    assert set(kinds[first_output:]) - {"response.in_progress"} == set(kinds[first_output:])
    assert final.status == "completed" and final.output_text == "Plain answer."
