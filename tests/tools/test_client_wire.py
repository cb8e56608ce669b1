"""Wire shapes of the real agent clients, replayed without npm (issue 23).

tests/fixtures/clients holds the first turn of Codex CLI, Claude Code and opencode as each sent it
to kvfork (`kvfork clients --record`, then tools/clients/fixtures.py): headers and body shapes,
with every piece of the clients' prose replaced by a placeholder. Each request is replayed against
a daemon as the client sent it; the status and the event sequence must be what the client reads.
The live run with the clients themselves is `make clients` (docs/agents.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import aiohttp
import pytest

from agent_server import agent_model  # noqa: F401
from http_daemon import serving
from scripted_replies import scripted

FIXTURES = Path(__file__).parents[1] / "fixtures" / "clients"
CLIENTS = sorted(p.stem for p in FIXTURES.glob("*.json"))
CONTEXT = 65536  # the model `kvfork clients` serves


def reply(history: str) -> str:
    """A short answer with a thought before it: it completes a turn whether or not the template
    opened the think block (Claude Code asks for adaptive thinking)."""
    return "<think>\nA short answer.\n</think>\n\nPlain answer."


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def long_model(agent_model, tmp_path_factory) -> str:
    """The agent model with the 64k context of the tiny model `kvfork clients` serves."""
    folder = tmp_path_factory.mktemp("long")
    shutil.copytree(agent_model, folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def frames(raw: str) -> list[tuple[str | None, object]]:
    """(event name, decoded data) per SSE frame; comments (keep-alives) left out."""
    out = []
    for block in raw.split("\n\n"):
        lines = [line for line in block.splitlines() if line and not line.startswith(":")]
        if not lines:
            continue
        event = next((line[7:] for line in lines if line.startswith("event: ")), None)
        data = "".join(line[6:] for line in lines if line.startswith("data: "))
        out.append((event, data if data == "[DONE]" else json.loads(data)))
    return out


def check_responses_stream(events: list) -> None:
    kinds = [data["type"] for _, data in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"  # Codex ends a turn with an error on anything else
    assert [name for name, _ in events] == kinds
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    added = [d["output_index"] for _, d in events if d["type"] == "response.output_item.added"]
    done = [d["output_index"] for _, d in events if d["type"] == "response.output_item.done"]
    assert added == done


def check_messages_stream(events: list) -> None:
    kinds = [data["type"] for _, data in events if data["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert [name for name, data in events] == [data["type"] for _, data in events]
    starts = [d["index"] for _, d in events if d["type"] == "content_block_start"]
    stops = [d["index"] for _, d in events if d["type"] == "content_block_stop"]
    assert starts == stops == list(range(len(starts)))
    start = next(d for _, d in events if d["type"] == "message_start")["message"]["usage"]
    final = next(d for _, d in events if d["type"] == "message_delta")["usage"]
    assert (start["input_tokens"], start["cache_read_input_tokens"]) == (final["input_tokens"],
                                                                         final["cache_read_input_tokens"])


def check_chat_stream(events: list) -> None:
    assert events[-1] == (None, "[DONE]")
    chunks = [data for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert any(choice.get("finish_reason") for c in chunks for choice in c["choices"])


CHECKS = {"/v1/responses": check_responses_stream, "/v1/messages": check_messages_stream,
          "/v1/chat/completions": check_chat_stream}


def test_fixtures_hold_no_client_prose():
    assert CLIENTS == ["claude", "codex", "opencode"]
    for name in CLIENTS:
        text = json.dumps([request["body"] for request in fixture(name)["requests"]])
        for word in ("You are", "Claude", "Codex", "opencode"):  # as their system prompts name themselves
            assert word not in text, (name, word)


@pytest.mark.parametrize("name", CLIENTS)
async def test_a_clients_first_turn_replays(name, long_model):
    recorded = fixture(name)
    async with serving(long_model, scripted(long_model, reply, context_length=CONTEXT), accept_any_model=True) as d, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        for request in recorded["requests"]:
            path = request["path"].split("?", 1)[0]
            headers = {k: v for k, v in request["headers"].items() if v != "<value>"}
            body = json.dumps(request["body"]) if request["body"] is not None else None
            async with http.request(request["method"], d.url + request["path"], data=body, headers=headers) as r:
                raw = await r.text()
                assert r.status == 200, (name, path, raw[:300])
            streamed = isinstance(request["body"], dict) and request["body"].get("stream")
            if path in CHECKS and streamed:
                CHECKS[path](frames(raw))
            elif path in CHECKS:
                assert json.loads(raw)["id"]
