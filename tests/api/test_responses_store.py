"""The response store's bookkeeping (pure) and the Responses input → chat messages mapping."""

from __future__ import annotations

import pytest

from kvfork.server.api.responses.protocol import Response
from kvfork.server.api.responses.store import ResponseStore
from kvfork.server.api.responses.translate import chat_messages
from kvfork.server.guard.errors import ApiError


def made(rid: str) -> Response:
    return Response(id=rid, created_at=0, model="m", status="completed", output=[], tools=[], tool_choice="auto",
                    text={}, parallel_tool_calls=True, store=True)


def store(cap: int = 4) -> tuple[ResponseStore, list[str]]:
    forgotten: list[str] = []
    return ResponseStore(cap, lambda name, tenant: forgotten.append(name)), forgotten


def test_a_conversation_opens_its_session_at_its_first_continuation_and_a_branch_runs_without_one():
    responses, _ = store()
    responses.put(made("a"), [{"role": "user", "content": "1"}], None)  # a first response runs without a session
    assert responses.claim("a", "b") == "resp-b"  # b opens the conversation's session
    assert responses.claim("a", "c") is None  # a second continuation of a, while b runs
    responses.put(made("b"), [], "resp-b")
    assert responses.claim("a", "d") is None  # and after: the session holds b now
    assert responses.claim("b", "e") == "resp-b"


def test_a_failed_continuation_gives_the_head_back():
    responses, _ = store()
    responses.put(made("a"), [], None)
    assert responses.claim("a", "b") == "resp-b"
    responses.give_back("resp-b", "b", "a")
    assert responses.claim("a", "c") == "resp-b"


def test_the_cap_drops_the_oldest_and_frees_a_session_it_heads():
    responses, forgotten = store(cap=2)
    responses.put(made("a"), [], None)
    responses.put(made("b"), [], responses.claim("a", "b"))
    responses.put(made("c"), [], None)
    assert len(responses) == 2 and forgotten == []  # a went; it headed no session
    with pytest.raises(ApiError) as caught:
        responses.history("a")
    assert (caught.value.status, caught.value.code) == (404, "previous_response_not_found")
    responses.put(made("d"), [], None)  # b goes, and the session it heads with it
    assert forgotten == ["resp-b"]
    responses.put(made("e"), [], responses.claim("c", "e"))
    responses.put(made("f"), [], responses.claim("e", "f"))  # c and d go; c's session moved on to e, then f
    assert forgotten == ["resp-b"] and responses.claim("f", "g") == "resp-e"
    responses.give_back("resp-e", "g", "f")
    responses.delete("f")  # deleting a head frees its session too
    assert forgotten == ["resp-b", "resp-e"] and responses.get("e").response.id == "e"
    with pytest.raises(ApiError) as caught:
        responses.get("f")
    assert (caught.value.status, caught.value.code) == (404, "response_not_found")


def test_input_items_map_onto_chat_messages():
    items = [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "cut"}]},
    ]
    assert chat_messages(items) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}], "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": "", "reasoning_content": "cut"},
    ]
