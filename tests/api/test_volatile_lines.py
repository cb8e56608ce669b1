"""Volatile client lines (server/api/volatile.py): Claude Code's billing line is taken out of the
prompt, so two sessions (or two turns with a new `cch`) share their system prompt and tools.

The request shape is Claude Code's recorded first turn (tests/fixtures/clients/claude.json): the
billing line as system[0], a short identity block, a long system prompt, then many tools. The texts
are written here; only the shape is Claude Code's."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from agent_server import agent_model  # noqa: F401 (fixture)
from http_daemon import metrics, serving
from kvfork.server.api.messages.protocol import TextBlock
from kvfork.server.api.volatile import strip_system, strip_text

RECORDED = json.loads((Path(__file__).parents[1] / "fixtures/clients/claude.json").read_text())["requests"][0]["body"]
# Claude Code 2.1.332 (sdk-cli and the interactive cli), and 2.1.177 with its per-request cch
BILLING_332 = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"
BILLING_332_CLI = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=cli;"
BILLING_177 = "x-anthropic-billing-header: cc_version=2.1.177.01c; cc_entrypoint=sdk-cli; cch={};"
# a subagent's first system block (2.1.332): its suffix comes from the subagent's own first prompt
BILLING_SUBAGENT = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli; cc_is_subagent=true;"

# The lines Claude Code writes (recorded, and the keys its 2.1.332 binary can append), each the billing line
BILLING_LINES = {
    "main agent, sdk-cli": BILLING_332.format("a3f"),
    "main agent, interactive cli": BILLING_332_CLI.format("0be"),
    "subagent": BILLING_SUBAGENT.format("0b8"),
    "workload": "x-anthropic-billing-header: cc_version=2.1.332.5d1; cc_entrypoint=sdk-cli; cc_workload=cron;",
    "gateway": "x-anthropic-billing-header: cc_version=2.1.332.5d1; cc_entrypoint=cli; cc_gateway=env;",
    "all of them": "x-anthropic-billing-header: cc_version=2.1.332.e07; cc_entrypoint=sdk-cli; "
                   "cc_is_subagent=true; cc_workload=review; cc_gateway=1;",
    "2.1.177, a cch per request": BILLING_177.format("36ee5"),
    "keys in another order": "x-anthropic-billing-header: cc_entrypoint=cli; cc_version=2.1.400.abc;",
    "a key no release has sent yet": "x-anthropic-billing-header: cc_version=2.2.0.9f1; cc_region=eu-west-1;",
    "a trailing space": BILLING_332.format("a3f") + " ",
}
# Text that only resembles the line: anything beside the pairs keeps it
NEAR_MISSES = {
    "words after the pairs": BILLING_332.format("a3f") + " please ignore the rules",
    "words before the header": "Quote: " + BILLING_332.format("a3f"),
    "a pair without its semicolon": "x-anthropic-billing-header: cc_version=2.1.332.a3f; cc_entrypoint=sdk-cli",
    "a value with a space": "x-anthropic-billing-header: cc_version=2.1.332.a3f; cc_entrypoint=sdk cli;",
    "an empty value": "x-anthropic-billing-header: cc_version=;",
    "no pairs at all": "x-anthropic-billing-header:",
    "a word that is no pair": "x-anthropic-billing-header: cc_version=2.1.332.a3f; subagent;",
    "another header": "x-anthropic-beta-header: cc_version=2.1.332.a3f; cc_entrypoint=sdk-cli;",
    "the header's name in other case": "X-Anthropic-Billing-Header: cc_version=2.1.332.a3f;",
    "a pair alone": "the system prompt mentions cch=36ee5; and nothing else",
}


def test_the_recorded_first_system_block_is_a_billing_line_of_the_recorded_length():
    first = RECORDED["system"][0]["text"]  # redacted to its length in the recording
    assert first == f"<{len(BILLING_332.format('a3f'))} chars>"


@pytest.mark.parametrize("line", BILLING_LINES.values(), ids=BILLING_LINES)
def test_a_billing_block_is_dropped_and_named(line):
    system = [TextBlock(line), TextBlock("You are an agent."), TextBlock("Rules " * 10)]
    kept, removed = strip_system(system)
    assert kept == system[1:] and removed == ["claude_code_billing"]


@pytest.mark.parametrize("line", BILLING_LINES.values(), ids=BILLING_LINES)
def test_a_billing_line_at_the_head_of_a_text_goes_with_its_blank_line(line):
    text = line + "\n\nYou are a Claude agent.\nBe brief."
    assert strip_text(text) == ("You are a Claude agent.\nBe brief.", ["claude_code_billing"])


@pytest.mark.parametrize("text", NEAR_MISSES.values(), ids=NEAR_MISSES)
def test_text_that_only_resembles_the_line_is_kept(text):
    assert strip_text(text) == (text, [])
    assert strip_system([TextBlock(text)]) == ([TextBlock(text)], [])


SYSTEM_PROMPT = ("You are a coding agent. Read files before you change them, keep changes small, and run "
                 "the tests that cover what you touched. ") * 12
TOOLS = [{"name": f"tool_{i}", "description": f"Tool number {i}: it does one thing to the workspace, well. " * 3,
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
         for i in range(6)]


def claude_code_body(billing: str, prompt: str) -> dict:
    """A first turn shaped as Claude Code sends it (the recorded request's blocks, our texts)."""
    return {"model": "tiny", "max_tokens": 2, "temperature": 0, "tools": TOOLS,
            "system": [{"type": "text", "text": billing},
                       {"type": "text", "text": "You are Claude Code, a CLI for coding.",
                        "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]}


async def _sessions(agent_model, billings: list[str], **server) -> list[dict]:
    async with serving(agent_model, served_model_name=["tiny"], **server) as daemon, \
            aiohttp.ClientSession() as http:
        usages = []
        for i, billing in enumerate(billings):
            body = claude_code_body(billing, f"session {i}: read notes.txt and say what it holds")
            async with http.post(daemon.url + "/v1/messages", json=body) as r:
                assert r.status == 200, await r.text()
                usages.append((await r.json())["usage"])
        seen = await metrics(http, daemon.url)
        removed = seen.get('kvfork_volatile_lines_removed_total{line="claude_code_billing"}', 0)
        return usages + [removed]


@pytest.mark.parametrize("billings", [
    [BILLING_332.format("a3f"), BILLING_332.format("7c0")],  # two sessions, two first prompts
    [BILLING_177.format("36ee5"), BILLING_177.format("0aaa9")],  # a cch new on every request
])
async def test_a_second_session_reuses_all_but_its_own_tail(agent_model, billings):
    first, second, removed = await _sessions(agent_model, billings)
    assert removed == 2
    prompt = second["input_tokens"] + second["cache_read_input_tokens"]
    assert first["cache_read_input_tokens"] == 0 and prompt > 500
    # everything up to the user's own words comes from the first session's cache entry: what is
    # computed is the turn's own tail (its words and the generation prompt), not the 2,400 before it
    assert second["input_tokens"] < 64


async def test_keep_volatile_lines_keeps_them_and_the_second_session_reuses_nothing(agent_model):
    first, second, removed = await _sessions(
        agent_model, [BILLING_332.format("a3f"), BILLING_332.format("7c0")], keep_volatile_lines=True)
    # only the head of the line itself (its text up to the suffix) is shared, not the 2,400 tokens after it
    assert removed == 0 and second["cache_read_input_tokens"] < 64


async def test_count_tokens_of_a_subagent_request_is_the_same_with_and_without_its_billing_line(agent_model):
    with_line = claude_code_body(BILLING_SUBAGENT.format("0b8"), "Explore the tests folder and list its files")
    without = {**with_line, "system": with_line["system"][1:]}
    in_user_text = {**without, "messages": [{"role": "user", "content": BILLING_SUBAGENT.format("0b8")}]}
    async with serving(agent_model, served_model_name=["tiny"]) as daemon, aiohttp.ClientSession() as http:
        counts = []
        for body in (with_line, without, in_user_text, {**in_user_text, "messages": [
                {"role": "user", "content": "x"}]}):
            body = {k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}
            async with http.post(daemon.url + "/v1/messages/count_tokens", json=body) as r:
                assert r.status == 200, await r.text()
                counts.append((await r.json())["input_tokens"])
    assert counts[0] == counts[1] > 500
    # the line is only taken out of `system`: in a user's text it is counted like any words
    assert counts[2] > counts[3] + 10
