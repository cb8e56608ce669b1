"""`--prefix-cache-warm FILE`: prompts computed at start, so a team's system prompt is warm before
the first request comes (and, with the disk tier, restored rather than computed on later starts).

The file is JSON: a list whose items are either a chat `messages` list, or an object
`{"messages": [...], "tenant": NAME}` naming the tenant (api.Scope) the entry belongs to; without
one it belongs to the default scope. Each prompt is rendered by the chat template with the
generation prompt, as a chat request with the same messages is, and run for one token.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfork.backends.base import SamplingParams
from kvfork.server.engine.api import GenerateRequest, Scope

if TYPE_CHECKING:  # the CLI reads the file before anything heavy loads
    from kvfork.server.engine.loop.engine import Engine
    from kvfork.server.text.tokenizer import PromptTokenizer

log = logging.getLogger("kvfork.warm")


def read_warm_file(path: str) -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, tenant) per prompt; ValueError names what is wrong."""
    try:
        items = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of prompts")
    out = []
    for i, item in enumerate(items):
        messages, tenant = (item.get("messages"), item.get("tenant", "")) if isinstance(item, dict) else (item, "")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{path} item {i}: expected a non-empty list of chat messages")
        if not isinstance(tenant, str):
            raise ValueError(f"{path} item {i}: tenant must be a string")
        out.append((messages, tenant))
    return out


async def warm(engine: "Engine", tokenizer: "PromptTokenizer", path: str) -> int:
    """Run each prompt of the file for one token; returns how many ran. A prompt that fails is
    logged and skipped: warming is optional work."""
    done = 0
    for i, (messages, tenant) in enumerate(read_warm_file(path)):
        try:
            prompt = await tokenizer.encode_rendered(await tokenizer.render_chat(messages))
            handle = engine.submit(GenerateRequest(f"warm-{i}", prompt, SamplingParams(), max_tokens=1,
                                                   scope=Scope(tenant)))
            async for event in handle:
                pass
            if handle.done is not None and handle.done.error:
                raise RuntimeError(handle.done.error)
            done += 1
        except Exception as exc:
            log.warning("warm prompt %d skipped: %s", i, exc)
    return done
