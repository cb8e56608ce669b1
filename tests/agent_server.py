"""A daemon for agent-client tests: the tiny model with a tools-and-thinking template, on a
scripted backend that writes chosen text, reached with the official `openai` and `anthropic` clients."""

from __future__ import annotations

import pytest

from agent_models import with_agent_template
from http_daemon import serving
from scripted_replies import scripted

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# What the scripted model writes, by the last user turn (the forced openings of
# tool_choice required/named are the start of the turn it completes).
REPLIES = {
    "weather?": "Let me check.\n" + CALL,
    "two calls": CALL + "\n" + CALL.replace("Paris", "Oslo"),
    "think first": "<think>\nThe user wants a greeting.\n</think>\n\nHello there!",
    "forced": CALL,
    "forced broken": "<tool_call>\n{not json}\n</tool_call>",
    "say stop": "one two STOP three",
    "go on": "and on " * 1500,  # longer than any test lets a request run
    "no think": "<think>\n\n</think>\n\nNo thinking.",  # the template closed the block (enable_thinking false)
}


def reply(history: str) -> str:
    last = history.rsplit("<|im_start|>user\n", 1)[-1]
    if "<tool_response>" in last:
        return "It is sunny in Paris."
    text = last.split("<|im_end|>", 1)[0]
    return REPLIES.get(text, "Plain answer.")


@pytest.fixture(scope="session")
def agent_model(tiny_model_dir, tmp_path_factory) -> str:
    return str(with_agent_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("agent")))


@pytest.fixture
async def daemon(agent_model):
    async with serving(agent_model, scripted(agent_model, reply), served_model_name=["tiny"], api_key=["sekrit"]) as d:
        yield d


@pytest.fixture
def oai(daemon, sdk):
    return sdk.openai(daemon, api_key="sekrit")


@pytest.fixture
def claude(daemon, sdk):
    return sdk.anthropic(daemon, api_key="sekrit")


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CLAUDE_TOOL = {"name": "get_weather", "description": "Weather in a city",
               "input_schema": WEATHER["function"]["parameters"]}
