"""What the reuse page (`/`) and its JSON (`GET /debug/reuse`) show: what is cached now, as a tree of
shared prefixes; the live requests and whom they clone from or follow; named sessions; the last
placement decisions with the prefill tokens each saved; hit rate and tokens saved over time.

Nothing here holds or shows prompt text or a tenant's name: token counts, scope digests (the index's,
an HMAC under the daemon's key) and request ids only. Every record keeps its tenant so that a caller
keyed as one tenant sees only that tenant's requests, entries and sessions (`view(tenant=...)`);
the operator's view (`tenant=None`) sees them all, still without names.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from kvfork.server.engine.api import Scope, Usage
from kvfork.server.engine.policy.entries import Entry
from kvfork.server.engine.policy.matching import common_prefix

DECISIONS = 300  # placement decisions kept
BUCKET_S = 10.0  # the time series' step
BUCKETS = 360  # an hour of them
SCOPES_PER_TENANT = 256  # scope digests remembered per tenant (to show it its own cache entries)


@dataclass
class Bucket:
    start: float
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0


@dataclass
class ReuseLog:
    """Fed by the one response driver (server/api/respond.py) as each request ends."""

    decisions: deque = field(default_factory=lambda: deque(maxlen=DECISIONS))  # (tenant, record)
    series: dict[str, deque] = field(default_factory=dict)  # tenant -> its buckets
    scopes: dict[str, dict[str, None]] = field(default_factory=dict)  # tenant -> scope digests it used

    def ended(self, request_id: str, scope: Scope, digest: str, usage: Usage) -> None:
        now = time.time()
        decision = usage.decision
        self.decisions.append((scope.tenant, {
            "request_id": request_id, "at": round(now, 3), "scope": digest[:12],
            "prompt_tokens": usage.prompt_tokens, "saved_tokens": usage.reused_tokens,
            "source": usage.reuse_source or "none", "reason": reason(usage),
            "donor": decision.get("donor"), "leader": decision.get("leader"),
        }))
        buckets = self.series.setdefault(scope.tenant, deque(maxlen=BUCKETS))
        start = now - now % BUCKET_S
        if not buckets or buckets[-1].start != start:
            buckets.append(Bucket(start))
        bucket = buckets[-1]
        bucket.requests += 1
        bucket.prompt_tokens += usage.prompt_tokens
        bucket.reused_tokens += usage.reused_tokens
        seen = self.scopes.setdefault(scope.tenant, {})
        seen[digest] = None
        if len(seen) > SCOPES_PER_TENANT:
            del seen[next(iter(seen))]

    def view(self, engine: Any, tenant: str | None) -> dict[str, Any]:
        """The page's data, for one tenant (or all: None)."""
        def mine(owner: str) -> bool:
            return tenant is None or owner == tenant

        index = engine.serving.index if engine.loaded else None
        scopes = None if tenant is None else set(self.scopes.get(tenant, ()))
        entries = [] if index is None else [e for tier in ("memory", "disk") for e in index.entries(tier)
                                            if scopes is None or e.scope in scopes]
        named = [] if index is None else [e for e in index.entries("named") if mine(e.owner[0])]
        return {
            "now": round(time.time(), 3),
            "bucket_s": BUCKET_S,
            "series": self._series(tenant),
            "decisions": [record for owner, record in reversed(self.decisions) if mine(owner)],
            "live": live_requests(engine.requests() if index is not None else [], tenant),
            "cache": {"entries": len(entries), "bytes": sum(e.nbytes for e in entries),
                      "tree": prefix_tree(entries)},
            "sessions": [{"name": e.owner[1], "scope": e.scope[:12], "tokens": len(e.tokens), "bytes": e.nbytes,
                          "age_s": _age(e), "uses": e.uses} for e in named],
        }

    def _series(self, tenant: str | None) -> list[dict[str, Any]]:
        merged: dict[float, Bucket] = {}
        for owner, buckets in self.series.items():
            if tenant is not None and owner != tenant:
                continue
            for b in buckets:
                into = merged.setdefault(b.start, Bucket(b.start))
                into.requests += b.requests
                into.prompt_tokens += b.prompt_tokens
                into.reused_tokens += b.reused_tokens
        return [{"t": b.start, "requests": b.requests, "prompt_tokens": b.prompt_tokens,
                 "reused_tokens": b.reused_tokens} for _, b in sorted(merged.items())]


def reason(usage: Usage) -> str:
    """Why the request started where it did, in the placement's words (engine/policy/placement.py's log fields)."""
    decision = usage.decision
    if usage.reuse_source == "donor":
        return "followed a leader" if decision.get("follow") else "cloned a running request"
    if usage.reuse_source == "disk":
        return "restored from disk (cheaper than recomputing)"
    if usage.reuse_source in ("cache", "session"):
        return {"cache": "prefix cache", "session": "named session"}[usage.reuse_source]
    if decision.get("disk") in ("slower", "no_gain"):
        return "computed: reading the disk tier was dearer"
    return "computed: nothing reusable" + (f" ({decision['follow_reason']})" if decision.get("follow_reason") else "")


def live_requests(requests: Iterable[Any], tenant: str | None) -> list[dict[str, Any]]:
    requests = list(requests)
    names = {r.rid: r.req.request_id for r in requests}
    out = []
    for r in requests:
        if tenant is not None and r.req.scope.tenant != tenant:
            continue
        order = getattr(r.phase, "order", None)  # a Following request's follow order
        out.append({"request_id": r.req.request_id, "phase": type(r.phase).__name__.lower(),
                    "prompt_tokens": len(r.prompt), "committed": r.committed_prompt, "reused_tokens": r.reused,
                    "source": r.reuse_source, "donor": r.decision.get("donor"),
                    "leader": names.get(order.leader) if order is not None else r.decision.get("leader"),
                    "age_s": round(time.monotonic() - r.submitted_at, 3)})
    return out


def _age(entry: Entry) -> float:
    return round(time.monotonic() - entry.created, 3)


def _entry(entry: Entry) -> dict[str, Any]:
    return {"tokens": len(entry.tokens), "bytes": entry.nbytes, "tier": entry.tier, "age_s": _age(entry),
            "uses": entry.uses}


def prefix_tree(entries: list[Entry]) -> list[dict[str, Any]]:
    """Entries as a tree of the prefixes they share, a root per scope: each node is the longest prefix its
    entries share (`tokens`: its length), the entries that end there, and the nodes that part below it."""
    by_scope: dict[str, list[Entry]] = {}
    for entry in entries:
        by_scope.setdefault(entry.scope, []).append(entry)
    return [{"scope": scope[:12], **_node(group, 0)} for scope, group in sorted(by_scope.items())]


def _node(group: list[Entry], shared: int) -> dict[str, Any]:
    """The tree of `group`, whose prompts share their first `shared` tokens, built on an explicit stack: a
    chain of conversation turns nests once per turn, deeper than Python's recursion limit."""
    top: dict[str, Any] = {}
    stack = [(group, shared, top)]
    while stack:
        group, shared, node = stack.pop()
        first = group[0].tokens
        depth = min(len(e.tokens) for e in group)
        for e in group[1:]:
            depth = min(depth, common_prefix(e.tokens, first, shared))
        parts: dict[int, list[Entry]] = {}
        for e in group:
            if len(e.tokens) > depth:
                parts.setdefault(e.tokens[depth], []).append(e)
        node.update(tokens=depth, entries=[_entry(e) for e in group if len(e.tokens) == depth], children=[])
        for part in parts.values():
            node["children"].append(child := {})
            stack.append((part, depth + 1, child))
    return top
