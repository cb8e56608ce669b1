"""JSONL traces: one request per line, replayed with their timing and sessions.

Each line holds `t` (seconds from the trace's start), `session`, and either
`messages` (OpenAI chat messages) or token counts: `prompt_tokens`, with an
optional shared part `prefix` (a name) of `prefix_tokens`; lines naming the
same prefix share its text. `max_tokens` is optional (default 32), `id` too.
A session's requests go out in order: each waits for the previous one to
finish and for its own `t`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kvfork.tools.bench.text import words
from kvfork.tools.bench.workload import Call, Workload


class TraceError(ValueError):
    pass


def _messages(row: dict, seed: int, lineno: int, where: str) -> list[dict]:
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise TraceError(f"{where}: `messages` must be a list of {{role, content}} objects")
        return msgs
    if "prompt_tokens" not in row:
        raise TraceError(f"{where}: needs `messages` or `prompt_tokens`")
    total, shared = int(row["prompt_tokens"]), int(row.get("prefix_tokens", 0))
    if total <= 0 or not 0 <= shared <= total:
        raise TraceError(f"{where}: need prompt_tokens > 0 and 0 <= prefix_tokens <= prompt_tokens")
    msgs = []
    if shared:
        prefix_rng = random.Random(f"{seed}:prefix:{row.get('prefix', 'shared')}")
        msgs.append({"role": "system", "content": words(prefix_rng, shared)})
    own_rng = random.Random(f"{seed}:line{lineno}")
    msgs.append({"role": "user", "content": words(own_rng, max(1, total - shared))})
    return msgs


def load(path: str | Path, seed: int = 0) -> Workload:
    calls: list[Call] = []
    last_in_session: dict[str, str] = {}
    lines = Path(path).read_text().splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        session = str(row.get("session", f"line{lineno}"))
        cid = str(row.get("id", f"trace-{lineno}"))
        calls.append(
            Call(
                cid,
                session,
                _messages(row, seed, lineno, where),
                int(row.get("max_tokens", 32)),
                after=last_in_session.get(session),
                not_before_s=float(row.get("t", 0.0)),
                tag="trace",
            )
        )
        last_in_session[session] = cid
    if not calls:
        raise TraceError(f"{path}: no requests")
    return Workload(Path(path).stem, calls)
