"""`kvfork clients`' scripted proxy (tools/clients/proxy.py) in the subagent step: in the turn that asks for
subagents, the main agent's requests are made to call the Agent tool once per subagent, each call with
its own prompt and nothing else; a subagent's own requests, and the main agent's once every subagent has
answered, end with the short JSON reply. The requests are Claude Code's, in their recorded shape
(tests/fixtures/clients/subagents/claude.json)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from kvfork.tools.clients.proxy import END_SCHEMA, SUBAGENT, ScriptedCall, steer
from kvfork.tools.clients.run import SUBAGENTS, SUBAGENTS_PROMPT

MAIN, FIRST, _ = (r["body"] for r in json.loads(
    (Path(__file__).parents[1] / "fixtures/clients/subagents/claude.json").read_text())["requests"])
READ = ScriptedCall("Read", {"file_path": "/work/notes.txt"})


def main_agent(answered: int) -> dict:
    """The main agent's request in the subagent turn, after `answered` subagents have answered."""
    body = copy.deepcopy(MAIN)
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": SUBAGENTS_PROMPT}]}]
    for i in range(answered):
        body["messages"] += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Agent",
                                               "input": {"description": f"subagent {i + 1}", "prompt": "..."}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": "done"}]}]
    return body


def agent_schema(body: dict) -> dict:
    return next(t["input_schema"] for t in body["tools"] if t["name"] == "Agent")


def test_the_main_agent_starts_each_subagent_with_its_own_prompt_then_ends():
    for answered, prompt in enumerate(SUBAGENTS.prompts):
        body = main_agent(answered)
        assert steer("messages", body, READ, SUBAGENTS)
        assert body["tool_choice"] == {"type": "tool", "name": "Agent"}
        assert agent_schema(body)["properties"] == {
            "description": {"type": "string", "enum": [f"subagent {answered + 1}"]},
            "prompt": {"type": "string", "enum": [prompt]}}
    body = main_agent(len(SUBAGENTS.prompts))
    assert not steer("messages", body, READ, SUBAGENTS)
    assert body["output_config"]["format"]["schema"] == END_SCHEMA and body["tool_choice"] == {"type": "none"}


def test_a_subagent_ends_with_the_short_reply():
    body = copy.deepcopy(FIRST)
    body["system"][0]["text"] = f"x-anthropic-billing-header: cc_version=2.1.332.0b8; cc_entrypoint=sdk-cli; {SUBAGENT}"
    body["messages"][0]["content"][1]["text"] = SUBAGENTS.prompts[0]
    assert not steer("messages", body, READ, SUBAGENTS)
    assert body["output_config"]["format"]["schema"] == END_SCHEMA
