"""Claude Code's subagents over HTTP (issue 44): the main agent starts two subagents with the Agent tool,
each with its own first prompt. A subagent's billing line (`cc_is_subagent=true;`, its suffix from its
own first prompt) is taken out, so the two share their system prompt and tools: sent one after the
other, the second reads them from the prefix cache; sent together, one clones the other while it
prefills or decodes (following or active reuse). Either way each greedy reply is the one it gets with
nothing to reuse. (On this tiny random model the reply hangs on the prompt's last tokens more than on
what the reused state holds: the state itself is compared with a fresh prefill, within tolerance.py's
bound, in the backends' contract tests, tests/backends/test_contract.py.)

The requests are tests/fixtures/clients/subagents/claude.json, recorded from Claude Code 2.1.332 in
`kvfork clients`' subagent step: the main agent's first request of the turn, then each subagent's first
request (every piece of the client's prose a placeholder, filled here with words at a twentieth of its
recorded length: the tools' schemas, kept whole, make most of the tokens).
They are replayed as Claude Code sends them (its path, headers and streamed body), with `temperature` 0
and thinking off, so that the greedy reply is text to compare. A `cache_salt` per case keeps the cases
apart on the one daemon each backend serves, and a fresh salt is a request with nothing to reuse."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from agent_models import with_agent_template
from http_daemon import serving
from kvfork.backends import create_backend
from tiny_models import write_model

pytestmark = pytest.mark.asyncio(loop_scope="module")

RECORDED = json.loads((Path(__file__).parents[1] / "fixtures/clients/subagents/claude.json").read_text())
# each request's billing line (redacted in the recording): a subagent's suffix comes from its own first prompt
BILLINGS = ("x-anthropic-billing-header: cc_version=2.1.332.a3f; cc_entrypoint=sdk-cli;",
            "x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; cc_is_subagent=true;",
            "x-anthropic-billing-header: cc_version=2.1.332.e41; cc_entrypoint=sdk-cli; cc_is_subagent=true;")
MAIN, FIRST, SECOND = ({**recorded, "billing": line} for recorded, line in zip(RECORDED["requests"], BILLINGS))
PROSE_SCALE = 0.05
WORDS = "the a file read write test agent tool call search code path line each when model cache prompt".split()
REUSE_MIN = 64  # the prefix cache's shortest match and active reuse's least saving, both at their default
# one narrow layer and a 16k context: the main agent's prompt is ~6k tokens of the tiny tokenizer's. Its
# own head: with tied embeddings a random model's greedy reply repeats the prompt's last token (a newline)
SHAPE = dict(max_position_embeddings=16384, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def subagent_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("subagents")
    return str(with_agent_template(write_model(folder / "model", "llama", **SHAPE), folder / "agent"))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["mlx", "torch"])
async def daemon(request, subagent_model):
    pytest.importorskip("mlx.core" if request.param == "mlx" else "torch")
    # memory alone: the cases need no disk tier; prefill chunks of 64 tokens keep a subagent's prompt in
    # prefill for dozens of steps, so the other, sent beside it, is placed while it runs however fast the machine
    engine = dict(prefix_cache_min_tokens=REUSE_MIN, active_prefix_reuse_min_tokens=REUSE_MIN,
                  prefix_cache_disk_bytes=0, prefill_chunk=REUSE_MIN)
    async with serving(subagent_model, create_backend(request.param), engine=engine, accept_any_model=True) as d:
        yield d


def filled(value, where: str = ""):
    """The recorded shape with each `<N chars>` placeholder filled with words, the same words wherever the
    same place (its key path, a tool by its name) holds a placeholder of the same length."""
    if isinstance(value, dict):
        return {k: filled(v, f"{where}/{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [filled(v, f"{where}/{v.get('name', i) if isinstance(v, dict) else i}") for i, v in enumerate(value)]
    if isinstance(value, str) and value.startswith("<") and value.endswith(" chars>"):
        rng, text = random.Random(where + value), ""
        while len(text) < int(value[1:-len(" chars>")]) * PROSE_SCALE:
            text += rng.choice(WORDS) + " "
        return text.rstrip() + "."
    return value


def body_of(recorded: dict, salt: str, **extra) -> dict:
    body = filled(recorded["body"]) | {"max_tokens": 12, "temperature": 0, "thinking": {"type": "disabled"},
                                       "cache_salt": salt, **extra}
    body["system"][0]["text"] = recorded["billing"]
    return body


async def replay(http: aiohttp.ClientSession, url: str, recorded: dict, salt: str, **extra) -> dict:
    """One request as Claude Code sends it (streamed); its id, usage, reply text and kvfork's cache account."""
    headers = {k: v for k, v in recorded["headers"].items() if v not in ("<value>", "<key>")}
    async with http.post(url + recorded["path"], json=body_of(recorded, salt, **extra), headers=headers) as r:
        raw = await r.text()
        assert r.status == 200, raw[:300]
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "message_start")["message"]
    final = next(e for e in events if e["type"] == "message_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    return {"id": start["id"], "usage": final["usage"], "text": text, "account": final.get("kvfork_cache")}


def request_log(caplog, request_id: str) -> dict:
    """The per-request log line (kvfork.requests) of one request."""
    lines = [json.loads(r.getMessage().split(" ", 1)[1]) for r in caplog.records
             if r.name == "kvfork.requests" and r.getMessage().startswith("request {")]
    return next(line for line in lines if line["request_id"] == request_id)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def alone(daemon) -> dict:
    """Each subagent alone (a scope of its own: nothing to reuse): its greedy reply, and the prompt tokens
    the two share (cache diagnostics, comparing the second with the first)."""
    async with aiohttp.ClientSession() as http:
        first = await replay(http, daemon.url, FIRST, "alone-1", diagnostics={"previous_message_id": None})
        second = await replay(http, daemon.url, SECOND, "alone-2", diagnostics={"previous_message_id": first["id"]})
    assert first["usage"]["cache_read_input_tokens"] == second["usage"]["cache_read_input_tokens"] == 0
    return {"replies": [first["text"], second["text"]], "shared": second["account"]["shared_tokens"]}


async def test_subagents_one_after_the_other_share_their_system_prompt_and_tools(daemon, alone):
    async with aiohttp.ClientSession() as http:
        main = await replay(http, daemon.url, MAIN, "one-after-the-other")
        first = await replay(http, daemon.url, FIRST, "one-after-the-other")
        second = await replay(http, daemon.url, SECOND, "one-after-the-other")
    prompt = second["usage"]["input_tokens"] + second["usage"]["cache_read_input_tokens"]
    assert main["usage"]["input_tokens"] > 4000 and 2000 < alone["shared"] < prompt
    assert second["usage"]["cache_read_input_tokens"] >= alone["shared"] // REUSE_MIN * REUSE_MIN
    assert [first["text"], second["text"]] == alone["replies"]


async def test_subagents_sent_together_reuse_each_other_while_one_runs(daemon, alone, caplog):
    caplog.set_level(logging.INFO, logger="kvfork.requests")
    async with aiohttp.ClientSession() as http:
        replies = await asyncio.gather(replay(http, daemon.url, FIRST, "together"),
                                       replay(http, daemon.url, SECOND, "together"))
    # whichever the daemon placed second reused the other's state while it ran: it followed the other
    # while it prefilled, or cloned what it had committed (the request log says which)
    logs = [request_log(caplog, reply["id"]) for reply in replies]
    (later,) = [line for line in logs if line["reuse_source"] == "donor"]
    assert later["reused_tokens"] >= alone["shared"] // REUSE_MIN * REUSE_MIN, later
    assert [reply["text"] for reply in replies] == alone["replies"]
