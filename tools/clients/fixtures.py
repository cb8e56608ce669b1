"""Recorded client requests → wire-shape fixtures (tests/fixtures/clients), with no third party's text.

    python -m kvfork.tools.clients.fixtures RECORD_DIR tests/fixtures/clients

`kvfork clients --record RECORD_DIR` writes every request a client sent. A fixture keeps the
first turn's requests (up to the one that carries the tool result back) in their shape: methods,
paths, header names (and the values clients negotiate by: betas, versions, content types), body
keys, roles, item and block types, tool kinds and names, schema structure. Every piece of prose
(instructions, system prompts, message text, tool and parameter descriptions, tool output) and any
other string longer than LONG characters becomes a placeholder naming its length, so the prompts
the clients ship are not copied; the script's own turn text stays.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvfork.tools.clients.proxy import TURN

LONG = 48
PROSE_KEYS = {"text", "content", "description", "instructions", "system", "title", "output", "thinking",
              "signature", "summary"}
KEEP_HEADERS = {"content-type", "accept", "anthropic-version", "anthropic-beta", "openai-beta", "user-agent",
                "x-stainless-helper-method", "x-stainless-stream-helper", "x-app", "originator"}
DROP_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


def placeholder(text: str) -> str:
    return f"<{len(text)} chars>"


def scrub(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: scrub(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub(v, key) for v in value]
    if isinstance(value, str) and TURN not in value and (key in PROSE_KEYS or len(value) > LONG):
        return placeholder(value)
    return value


def scrub_headers(headers: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, value in headers.items():
        low = name.lower()
        if low in DROP_HEADERS:
            continue
        if low in ("authorization", "x-api-key"):
            out[name] = "<key>"
        else:
            out[name] = value if low in KEEP_HEADERS else "<value>"
    return out


def first_turn(entries: list[dict]) -> list[dict]:
    """The requests up to and including the first that carries a tool result back."""
    out = []
    for entry in entries:
        text = json.dumps(entry.get("body"))
        if f"{TURN}2" in text:
            break
        out.append(entry)
        if any(m in text for m in ('"function_call_output"', '"tool_result"', '"role": "tool"')):
            break
    return out


def fixture(entries: list[dict], client: str, version: str) -> dict:
    requests = [{"method": e["method"], "path": e["path"], "headers": scrub_headers(e["headers"]),
                 "body": scrub(e["body"]) if isinstance(e.get("body"), (dict, list)) else None}
                for e in first_turn(entries)]
    return {"client": client, "version": version, "requests": requests}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    source, target = Path(argv[0]), Path(argv[1])
    target.mkdir(parents=True, exist_ok=True)
    from kvfork.tools.clients.clients import CLIENTS

    for name, client in CLIENTS.items():
        path = source / f"{name}.jsonl"
        if not path.exists():
            continue
        entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        (target / f"{name}.json").write_text(json.dumps(fixture(entries, name, client.version), indent=1) + "\n")
        print(f"{target / (name + '.json')}: {len(first_turn(entries))} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
