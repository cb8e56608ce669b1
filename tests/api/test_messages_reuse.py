"""Reuse through /v1/messages on a tiny real model (MLX, float32): a resent agent
history is read from the prefix cache, and a request arriving while another with
the same history runs clones the running one's state (active prefix reuse)."""

from __future__ import annotations

import aiohttp
import pytest

from agent_server import agent_model  # noqa: F401 (fixture)
from http_daemon import metrics, serving

pytest.importorskip("mlx.core")

TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
SYSTEM = "You are a coding agent working in a shared repository. " * 4
HISTORY = [
    {"role": "user", "content": "open the file and search the code for the error"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "I will read it."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "server.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "the model cache prefix token prompt " * 6}]},
]


async def test_resent_history_reads_the_prefix_cache(agent_model, sdk):
    async with serving(agent_model, served_model_name=["tiny"]) as daemon:
        claude = sdk.anthropic(daemon)
        kwargs = dict(model="tiny", max_tokens=4, system=SYSTEM, tools=[TOOL], messages=HISTORY)
        first = await claude.messages.create(**kwargs)
        again = await claude.messages.create(**kwargs)
        prompt = first.usage.input_tokens
        assert first.usage.cache_read_input_tokens == 0 and prompt > 100
        assert (again.usage.input_tokens, again.usage.cache_read_input_tokens) == (1, prompt - 1)
        assert [b.model_dump() for b in again.content] == [b.model_dump() for b in first.content]


# The same history as an OpenAI client sends it: the donor runs through chat
# completions (ignore_eos keeps it decoding), the recipient comes through /v1/messages.
OPENAI_TWIN = [
    {"role": "system", "content": SYSTEM},
    HISTORY[0],
    {"role": "assistant", "content": "I will read it.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "server.py"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": HISTORY[2]["content"][0]["content"]},
]
OPENAI_TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                "parameters": TOOL["input_schema"]}}


async def test_a_request_while_its_history_runs_reuses_the_running_state(agent_model, sdk):
    # no cache: reuse can only be a donor, which decodes without drafts so it is still running when asked
    engine = dict(prefix_cache_entries=0, active_prefix_reuse_min_tokens=1, speculative="off")
    async with serving(agent_model, served_model_name=["tiny"], engine=engine) as daemon, \
            aiohttp.ClientSession() as http:
        donor_body = {"model": "tiny", "messages": OPENAI_TWIN, "tools": [OPENAI_TOOL], "max_tokens": 3000,
                      "ignore_eos": True, "temperature": 0, "logprobs": True, "stream": True}
        async with http.post(daemon.url + "/v1/chat/completions", json=donor_body) as donor:
            frames = (line async for line in donor.content if line.startswith(b"data: "))
            assert b'"role"' in await anext(frames)
            await anext(frames)  # its first token (logprobs make a chunk of it even if it is no text)
            # the donor has committed its prompt and decodes for seconds more: the recipient clones it
            follow_up = HISTORY + [{"role": "assistant", "content": "Found it."},
                                   {"role": "user", "content": "now fix it"}]
            recipient = await sdk.anthropic(daemon).messages.create(model="tiny", max_tokens=4, system=SYSTEM,
                                                              tools=[TOOL], messages=follow_up)
        donor_prompt = await sdk.anthropic(daemon).messages.count_tokens(model="tiny", system=SYSTEM, tools=[TOOL],
                                                                  messages=HISTORY)
        # all of the donor's prompt (the OpenAI twin of the history) is the recipient's too, and is reused
        shared = recipient.usage.cache_read_input_tokens
        assert shared == donor_prompt.input_tokens > 100 and recipient.usage.input_tokens > 0
        seen = await metrics(http, daemon.url)
        assert seen['kvfork_reused_tokens_total{source="donor"}'] == shared
