"""Message boundaries through the HTTP API on a tiny hybrid model (Qwen3.5, MLX, float32): a new
conversation with an earlier one's system prompt and tools is served from the prefix cache at the end
of that block, where the earlier request kept a checkpoint of its recurrent state (the chat renderer
found it: GenerateRequest.boundaries), and answers as it does with reuse off."""

from __future__ import annotations

import pytest

from agent_server import with_agent_template
from http_daemon import serving

pytest.importorskip("mlx.core")

TOOL = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
SYSTEM = "You are a coding agent working in a shared repository. " * 4
FIRST = [{"role": "user", "content": "open the file and search the code for the error"},
         {"role": "assistant", "content": "I will read it."},
         {"role": "user", "content": "now read the tests too"}]
OTHER = [{"role": "user", "content": "summarise the changes of the last week in two lines"}]


@pytest.fixture(scope="module")
def hybrid_agent_model(tiny_hybrid_dir, tmp_path_factory) -> str:
    return str(with_agent_template(tiny_hybrid_dir("qwen3_5"), tmp_path_factory.mktemp("hybrid-agent")))


async def test_a_new_conversation_reads_the_cache_where_the_shared_system_block_ends(hybrid_agent_model, sdk):
    kwargs = dict(model="tiny", max_tokens=6, system=SYSTEM, tools=[TOOL], extra_body={"temperature": 0})
    async with serving(hybrid_agent_model, served_model_name=["tiny"], engine=dict(prefix_cache_entries=0)) as cold:
        want = await sdk.anthropic(cold).messages.create(
            **kwargs, messages=OTHER)
    async with serving(hybrid_agent_model, served_model_name=["tiny"]) as daemon:
        claude = sdk.anthropic(daemon)
        first = await claude.messages.create(**kwargs, messages=FIRST)
        other = await claude.messages.create(**kwargs, messages=OTHER)
    read = other.usage.cache_read_input_tokens
    # The system and tools block (dozens of tokens), where the first request's conversation was kept;
    # its own message is prefilled. Without the checkpoint the snapshot (at the first prompt's end) serves nothing.
    assert 64 <= read < first.usage.input_tokens and other.usage.input_tokens > 0
    assert [b.model_dump() for b in other.content] == [b.model_dump() for b in want.content]
