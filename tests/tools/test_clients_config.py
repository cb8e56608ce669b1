"""`kvfork clients` configures each agent client as a user of the model's context would (no npm here:
the configuration files only)."""

import json
from pathlib import Path

import pytest

from kvfork.tools.clients.clients import CLIENTS


@pytest.mark.parametrize("context, compacts, output", [(8192, False, 1024), (65536, None, 4096)])
def test_opencode_on_a_small_context_leaves_room_and_does_not_compact_every_reply(tmp_path, context, compacts, output):
    """On the default model's 8k context opencode's own prompt (~7k tokens) sat past its compaction threshold
    with 4,096 tokens kept for output: it compacted after every reply and continued, 600 requests in 10 minutes."""
    env = CLIENTS["opencode"].configure(tmp_path, "http://127.0.0.1:1", context)
    config = json.loads(Path(env["OPENCODE_CONFIG"]).read_text())
    assert config["provider"]["kvfork"]["models"]["tiny"]["limit"] == {"context": context, "output": output}
    assert config.get("compaction", {}).get("auto") == compacts
