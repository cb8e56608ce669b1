"""Anthropic Messages shapes, their translation to chat requests, and reply/stream building."""

from __future__ import annotations

import json

import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from kvfork.server.api.messages.protocol import CountTokensRequest, MessagesRequest, error_body, sse
from kvfork.server.api.messages.reply import MessageStream, message_reply, usage
from kvfork.server.api.messages.translate import UnsupportedContent, chat_request
from kvfork.server.generate.chat_output import ChatOutputParser, collect
from kvfork.server.generate.reasoning import ReasoningSplitter
from kvfork.server.toolcalls import PARSERS
from streaming_helpers import counting_ids

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}

# An agent turn as Anthropic clients send it (cache_control, citations, metadata and
# other fields included) ...
AGENT_HISTORY = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 256,
    "system": [
        {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Work in /repo."},
    ],
    "tools": [
        {"name": "read_file", "description": "Read a file", "input_schema": SCHEMA, "cache_control": {"type": "ephemeral"}},
        {"name": "ls", "input_schema": {"type": "object"}},
    ],
    "tool_choice": {"type": "auto"},
    "messages": [
        {"role": "user", "content": "Fix the bug in main.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Read it first.", "signature": "sig"},
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "main.py"}},
                {"type": "tool_use", "id": "toolu_2", "name": "ls", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1/0)", "cache_control": {"type": "ephemeral"}},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "main.py"}], "is_error": False},
                {"type": "text", "text": "Be quick."},
            ],
        },
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_3", "name": "ls", "input": {"dir": "é"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3", "content": ""}]},
    ],
    "stop_sequences": ["</done>"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 20,
    "metadata": {"user_id": "u1"},
    "thinking": {"type": "enabled", "budget_tokens": 2048},
    "stream": False,
    "service_tier": "auto",
}

# ... and the same turn as an OpenAI chat-completions client sends it.
OPENAI_TWIN = {
    "model": "claude-sonnet-4-5",
    "max_tokens": 256,
    "messages": [
        {"role": "system", "content": [{"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": "Work in /repo."}]},
        {"role": "user", "content": "Fix the bug in main.py"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Reading it."}],
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "main.py"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
            ],
            "reasoning_content": "Read it first.",
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1/0)"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "text", "text": "main.py"}]},
        {"role": "user", "content": [{"type": "text", "text": "Be quick."}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "toolu_3", "type": "function", "function": {"name": "ls", "arguments": '{"dir": "é"}'}}],
        },
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ],
    "tools": [
        {"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
    ],
    "tool_choice": "auto",
    "chat_template_kwargs": {"enable_thinking": True},
    "stop": ["</done>"],
    "temperature": 0.5,
    "top_p": 0.9,
    "top_k": 20,
}


def decode(body: dict, type_=MessagesRequest):
    return msgspec.json.decode(json.dumps(body), type=type_)


def test_agent_history_translates_to_its_openai_twin():
    translated = chat_request(decode(AGENT_HISTORY))
    assert translated == OPENAI_TWIN
    # key order too: templates render tools with `tojson`, which keeps it
    assert json.dumps(translated["tools"]) == json.dumps(OPENAI_TWIN["tools"])


def test_count_tokens_request_translates_the_same_prompt():
    body = {k: AGENT_HISTORY[k] for k in ("model", "system", "tools", "tool_choice", "messages", "thinking")}
    counted = chat_request(decode(body, CountTokensRequest))
    assert counted == {k: v for k, v in OPENAI_TWIN.items() if k not in ("max_tokens", "stop", "temperature", "top_p", "top_k")}


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "ls"}, {"type": "function", "function": {"name": "ls"}}),
    ],
)
def test_tool_choice(choice, expected):
    body = dict(AGENT_HISTORY, tool_choice=choice)
    assert chat_request(decode(body))["tool_choice"] == expected
    body["tool_choice"] = dict(choice, disable_parallel_tool_use=True)
    assert chat_request(decode(body))["parallel_tool_calls"] is False


def test_minimal_request_and_thinking_disabled():
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "system": "Be brief."}
    assert chat_request(decode(body)) == {
        "model": "m", "max_tokens": 5,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    }
    out = chat_request(decode(dict(body, thinking={"type": "disabled"})))
    assert out["chat_template_kwargs"] == {"enable_thinking": False}


@pytest.mark.parametrize(
    "body, where",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"max_tokens": 0, "messages": []}, "max_tokens"),
        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "type"),
        ({"max_tokens": 5, "messages": [], "temperature": 1.5}, "temperature"),
        ({"max_tokens": 5, "messages": [], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ],
)
def test_invalid_requests_name_the_field(body, where):
    with pytest.raises(msgspec.ValidationError, match=where):
        decode(body)


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "document", "source": {}}],
        [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document", "source": {}}]}],
        [{"type": "image", "source": {"type": "file", "file_id": "file_1"}}],
    ],
)
def test_documents_and_file_images_are_unsupported(content):
    with pytest.raises(UnsupportedContent, match="not supported|no Files API"):
        chat_request(decode({"max_tokens": 5, "messages": [{"role": "user", "content": content}]}))


def test_images_become_chat_image_parts_in_user_turns_and_tool_results():
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    linked = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    result = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "shot:"}, linked]}
    messages = chat_request(decode({"max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "see"}, png, result]}]}))["messages"]
    assert messages == [
        {"role": "user", "content": [{"type": "text", "text": "see"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "tool", "tool_call_id": "t", "content": [
            {"type": "text", "text": "shot:"},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]


def test_tool_choice_tool_needs_a_name_and_a_custom_tool_a_schema():
    with pytest.raises(ValueError, match="^tool_choice: .*needs a name"):
        chat_request(decode({"max_tokens": 5, "messages": [], "tool_choice": {"type": "tool"}}))
    with pytest.raises(ValueError, match=r"^tools\[1\]: .*input_schema"):
        chat_request(decode({"max_tokens": 5, "messages": [], "tools": [AGENT_HISTORY["tools"][1], {"name": "x"}]}))


def test_server_tools_are_dropped():
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}
    body = dict(AGENT_HISTORY, tools=[web_search, *AGENT_HISTORY["tools"]])
    assert chat_request(decode(body))["tools"] == OPENAI_TWIN["tools"]
    assert "tools" not in chat_request(decode(dict(AGENT_HISTORY, tools=[web_search])))


def test_error_shape():
    assert json.loads(error_body(404, "no model x")) == {
        "type": "error", "error": {"type": "not_found_error", "message": "no model x"}
    }
    assert json.loads(error_body(429, "busy"))["error"]["type"] == "rate_limit_error"


# --- replies --------------------------------------------------------------------------------------

OUTPUT = (
    "<think>\nList first.\n</think>\n\nI'll list.\n"
    '<tool_call>\n{"name": "ls", "arguments": {"dir": "src"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
)


def output_parser():
    return ChatOutputParser(PARSERS["hermes"](None, counting_ids()), ReasoningSplitter())


def streamed(pieces: list[str], finish_reason: str = "stop", stop_sequence: str | None = None) -> list[dict]:
    """The stream's events as a client decodes them from the SSE bytes."""
    stream, parser = MessageStream("msg_1", "m"), output_parser()
    events = stream.start(usage(100, 60, 0))
    for piece in pieces:
        events += stream.events(parser.feed(piece))
    events += stream.events(parser.finish())
    events += stream.finish(finish_reason, stop_sequence, usage(100, 60, 30))
    out = []
    for event in events:
        head, data = sse(event).decode().split("\n", 1)
        assert head == f"event: {type(event).__struct_config__.tag}"
        out.append(json.loads(data.removeprefix("data: ")))
    return out


def test_stream_event_order():
    kinds = [(e["type"], e.get("content_block", e.get("delta", {})).get("type")) for e in streamed(list(OUTPUT))]
    assert kinds[0] == ("message_start", None)
    assert kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    starts = [k for t, k in kinds if t == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use", "tool_use"]
    assert kinds.count(("content_block_stop", None)) == 4


@pytest.mark.parametrize("pieces", [[OUTPUT], list(OUTPUT), [OUTPUT[:37], OUTPUT[37:90], OUTPUT[90:]]])
def test_stream_accumulates_to_the_whole_reply(pieces):
    """The SDK's own accumulator rebuilds, from our events, the reply the non-streaming route gives."""
    snapshot, bufs = None, {}
    for event in streamed(pieces):
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    parser = output_parser()
    whole = message_reply("msg_1", "m", collect(parser.feed(OUTPUT) + parser.finish()), "stop", None, usage(100, 60, 30))
    expected = msgspec.to_builtins(whole)
    got = snapshot.model_dump(exclude_none=True)
    assert got["content"] == expected["content"]
    assert got["content"][2] == {"type": "tool_use", "id": "call_0", "name": "ls", "input": {"dir": "src"}}
    assert (got["stop_reason"], got["usage"]["input_tokens"]) == ("tool_use", 40)
    assert (got["usage"]["cache_read_input_tokens"], got["usage"]["output_tokens"]) == (60, 30)


@pytest.mark.parametrize(
    "finish, stop_sequence, reason",
    [("stop", None, "end_turn"), ("length", None, "max_tokens"), ("stop", "</done>", "stop_sequence")],
)
def test_stop_reasons(finish, stop_sequence, reason):
    events = streamed(["Just text."], finish, stop_sequence)
    delta = events[-2]["delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == (reason, stop_sequence)
    parser = ChatOutputParser()
    reply = message_reply("m1", "m", collect(parser.feed("Just text.") + parser.finish()), finish, stop_sequence, usage(3, 0, 2))
    assert (reply.stop_reason, reply.stop_sequence) == (reason, stop_sequence)


@pytest.mark.parametrize(
    "role, block, match",
    [
        ("user", {"type": "tool_use", "id": "t", "name": "ls", "input": {}}, r"^messages\[0\]: tool_use blocks belong"),
        ("assistant", {"type": "tool_result", "tool_use_id": "t"}, r"^messages\[0\]: tool_result blocks belong"),
    ],
)
def test_blocks_in_the_wrong_turn_name_the_message(role, block, match):
    with pytest.raises(ValueError, match=match) as caught:
        chat_request(decode({"max_tokens": 5, "messages": [{"role": role, "content": [block]}]}))
    assert not isinstance(caught.value, UnsupportedContent)
