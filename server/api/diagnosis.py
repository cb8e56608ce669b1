"""Cache diagnostics: why a request reused less than the one it names, on every API.

A request opts in (Anthropic's `diagnostics` object; `prompt_cache_options` on Responses and on chat
completions, an extension there): its fingerprint is kept under its response id, and when it names an
earlier response the two are compared:

- where their prompt tokens first differ, and which part of the prompt holds that position (its
  system text, its tools, or the messages: each fingerprint keeps their spans in token positions,
  found by rendering the prompt without its system messages and without its tools), or that the
  model differs; that is the official answer, in each API's own words (`anthropic`, `openai`);
- what kvfork did with the prefix they share (`kvfork`): reused it all, or why not (the shared prefix
  was below the cache's minimum, another scope's, no longer held, or the disk tier's copy cost more
  to read than to compute). These are kvfork's own and go in their own field, never as new values of
  an official type.

A fingerprint holds token ids, never text; it is found only by its own tenant (another tenant's id
reads as not found), and the store is bounded by tokens: past the bound, the tenant holding the most loses
its oldest. Ids of responses that did not opt in are remembered (no tokens, bounded the same way) so that
naming one answers `unavailable` rather than not found. Both are stored once the engine has admitted the
request, so refused requests evict nothing.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from aiohttp import web

from kvfork.backends.vision.keys import IMAGE_KEY_BASE
from kvfork.server.api.openai import PromptCacheOptions
from kvfork.server.api.vision import SeenImage, vision_prompt
from kvfork.server.engine.api import Scope, Usage
from kvfork.server.guard.errors import ApiError
from kvfork.server.text.tokenizer import PromptTokenizer
from kvfork.server.watch.metrics import Registry

# What the store keeps at most: 4M tokens of fingerprints (16 MiB), and ids of responses made without
# diagnostics (a few MiB).
MAX_FINGERPRINT_TOKENS = 4 * 1024 * 1024
MAX_PLAIN_IDS = 65536

Span = tuple[int, int]
Reason = Literal["model_changed", "system_changed", "tools_changed", "messages_changed",
                 "previous_message_not_found", "unavailable"]
CHANGED = ("model_changed", "system_changed", "tools_changed", "messages_changed")
# Anthropic's reasons in OpenAI's words (Responses' cache_miss reasons, and its other outcomes)
OPENAI_REASONS = {"model_changed": "model_changed", "tools_changed": "tools_changed",
                  "system_changed": "input_changed", "messages_changed": "input_changed"}
OPENAI_OUTCOMES = {"previous_message_not_found": "comparison_response_not_found", "unavailable": "unavailable"}


@dataclass(frozen=True)
class Fingerprint:
    scope: Scope
    model: str
    prompt: array  # token ids
    system: Span  # where its system text lies in `prompt` ((0, 0): none)
    tools: Span


@dataclass(frozen=True)
class Diagnosis:
    reason: Reason | None  # None: nothing diverged
    shared: int = 0  # prompt tokens the two share from the start
    missed: int = 0  # the earlier prompt's tokens past `shared`: what a matching prefix would have reused
    compared: int = 0  # the earlier prompt's length
    other_scope: bool = False  # same tenant, another cache_salt

    def anthropic(self) -> dict[str, Any] | None:
        """Messages' `diagnostics`: null when nothing diverged."""
        if self.reason is None:
            return None
        reason: dict[str, Any] = {"type": self.reason}
        if self.reason in CHANGED:
            reason["cache_missed_input_tokens"] = self.missed
        return {"cache_miss_reason": reason}

    def openai(self) -> dict[str, Any]:
        """Responses' `prompt_cache_diagnostics` (and chat completions' extension of the same shape)."""
        if self.reason is None:
            return {"type": "cache_hit"}
        if self.reason in OPENAI_OUTCOMES:
            return {"type": OPENAI_OUTCOMES[self.reason]}
        return {"type": "cache_miss", "reason": OPENAI_REASONS[self.reason], "cache_missed_tokens": self.missed,
                "comparison_reusable_tokens": self.compared}

    def kvfork(self, usage: Usage, min_tokens: int) -> dict[str, Any] | None:
        """kvfork's own account of the prefix the two share (`kvfork_cache`), once the request ran."""
        if self.reason in OPENAI_OUTCOMES:
            return None
        usable = min(self.shared, usage.prompt_tokens - 1)  # the match rule: one token is always computed
        return {"shared_tokens": self.shared, "reused_tokens": usage.reused_tokens,
                "reuse_source": usage.reuse_source, "state": self.state(usage, usable, min_tokens)}

    def state(self, usage: Usage, usable: int, min_tokens: int) -> str:
        if usage.reused_tokens >= usable:
            return "reused"
        if self.other_scope:
            return "other_scope"
        if usable < min_tokens:
            return "below_minimum"
        if usage.decision.get("disk") == "slower":
            return "restore_dearer"
        return "not_held"


def common_prefix(a: Any, b: Any) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def span_of(prompt: list[int], without: list[int]) -> Span:
    """Where `prompt` holds what the same prompt rendered `without` some part lacks."""
    start = common_prefix(prompt, without)
    tail = common_prefix(prompt[start:][::-1], without[start:][::-1])
    return start, max(start, len(prompt) - tail)


def diagnose(now: Fingerprint, before: Fingerprint | None, known: bool) -> Diagnosis:
    if before is None:
        return Diagnosis("unavailable" if known else "previous_message_not_found")
    shared = common_prefix(before.prompt, now.prompt)
    other_scope = before.scope != now.scope
    if before.model != now.model:
        return Diagnosis("model_changed", shared, len(before.prompt), len(before.prompt), other_scope)
    if shared >= len(before.prompt):
        return Diagnosis(None, shared, 0, len(before.prompt), other_scope)
    reason: Reason = "messages_changed"
    for span, named in ((now.tools, "tools_changed"), (now.system, "system_changed"),
                        (before.tools, "tools_changed"), (before.system, "system_changed")):
        if span[0] <= shared < span[1]:
            reason = named  # type: ignore[assignment]
            break
    return Diagnosis(reason, shared, len(before.prompt) - shared, len(before.prompt), other_scope)


class _Kept:
    """One store of the tenants' entries under one bound on their total size: when it is over, the tenant
    holding the most gives up its oldest, so one tenant's requests never evict another tenant's below it."""

    def __init__(self, limit: int):
        self.limit, self.total = limit, 0
        self.by_tenant: dict[str, OrderedDict[str, Any]] = {}
        self.sizes: dict[str, int] = {}

    def get(self, tenant: str, rid: str) -> Any:
        return self.by_tenant.get(tenant, {}).get(rid)

    def has(self, tenant: str, rid: str) -> bool:
        return rid in self.by_tenant.get(tenant, {})

    def put(self, tenant: str, rid: str, value: Any, size: int) -> None:
        self.by_tenant.setdefault(tenant, OrderedDict())[rid] = (value, size)
        self.sizes[tenant] = self.sizes.get(tenant, 0) + size
        self.total += size
        while self.total > self.limit:
            most = max(self.sizes, key=self.sizes.__getitem__)
            kept = self.by_tenant[most]
            _, (_, freed) = kept.popitem(last=False)
            self.sizes[most] -= freed
            self.total -= freed
            if not kept:
                del self.by_tenant[most], self.sizes[most]


class Fingerprints:
    """Fingerprints by (tenant, response id), bounded by the tokens they hold, and the ids of responses made
    without one, bounded by their count: each bound shared, the tenant holding the most giving up its oldest.
    Both are stored once the engine has admitted the request (`Report.keep`, `made`): a refused request
    stores nothing."""

    def __init__(self, registry: Registry, max_tokens: int = MAX_FINGERPRINT_TOKENS, max_plain: int = MAX_PLAIN_IDS):
        self.kept = _Kept(max_tokens)
        self.plain = _Kept(max_plain)
        self.outcomes = registry.counter("cache_diagnoses_total", "cache diagnostics answered, by the official "
                                         "reason (none: nothing diverged)")
        self.states = registry.counter("cache_diagnosis_states_total", "what kvfork did with the prefix a "
                                       "diagnosed request shared with the one it named, by state")

    def keep(self, rid: str, fingerprint: Fingerprint) -> None:
        self.kept.put(fingerprint.scope.tenant, rid, fingerprint, max(1, len(fingerprint.prompt)))

    def made(self, rid: str, tenant: str) -> None:
        """A response made without diagnostics: naming it answers `unavailable`."""
        self.plain.put(tenant, rid, None, 1)

    def compare(self, now: Fingerprint, previous: str) -> Diagnosis:
        tenant = now.scope.tenant
        found = self.kept.get(tenant, previous)
        diagnosis = diagnose(now, found[0] if found is not None else None, self.plain.has(tenant, previous))
        self.outcomes.inc(reason=diagnosis.reason or "none")
        return diagnosis

    def count_state(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.states.inc(state=state["state"])


FINGERPRINTS = web.AppKey("fingerprints", Fingerprints)  # the daemon's, on its application (server/launch/app.py)


@dataclass
class Report:
    """What a reply says about cache diagnostics: the official answer (the same before and after the request
    runs: it compares the requests), and kvfork's account, made once when the request has run."""

    fingerprints: Fingerprints
    min_tokens: int  # the prefix cache's shortest match (--prefix-cache-min-tokens)
    fingerprint: Fingerprint  # this request's, kept once the engine admits it (`keep`)
    diagnosis: Diagnosis | None = None  # None: no response named
    account: dict[str, Any] | None = None

    def keep(self, rid: str) -> None:
        self.fingerprints.keep(rid, self.fingerprint)

    def anthropic(self) -> dict[str, Any] | None:
        return self.diagnosis.anthropic() if self.diagnosis is not None else None

    def openai(self) -> dict[str, Any] | None:
        return self.diagnosis.openai() if self.diagnosis is not None else None

    def ran(self, usage: Usage) -> dict[str, Any] | None:
        """kvfork's account (`kvfork_cache`), once the request has run."""
        if self.diagnosis is not None and self.account is None:
            self.account = self.diagnosis.kvfork(usage, self.min_tokens)
            self.fingerprints.count_state(self.account)
        return self.account


@dataclass(frozen=True)
class Asked:
    """A request's ask for diagnostics: the response it is compared with (None: none yet, only keep
    this one's fingerprint)."""

    previous: str | None = None


def asked_by(options: PromptCacheOptions | None) -> Asked | None:
    """OpenAI's `prompt_cache_options` (Responses, and chat completions' extension) as an ask."""
    return Asked(options.comparison_response_id) if options is not None else None


async def fingerprint(tokenizer: PromptTokenizer, scope: Scope, model: str, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, kwargs: dict[str, Any], prompt: list[int],
                      images: Sequence[SeenImage] = ()) -> Fingerprint:
    """The prompt's fingerprint; its system and tools spans are where the prompt rendered without its leading
    system messages, or without its tools, differs from it ((0, 0) when it has none, or the template refuses
    the cut). `images`: the prompt's, encoded as its keys in the cuts too (server/api/vision.py)."""
    async def without(cut: list[dict[str, Any]], cut_tools: list[dict[str, Any]] | None) -> Span:
        try:
            text = await tokenizer.render_chat(cut, cut_tools, kwargs, scope.tenant)
        except ApiError:
            return 0, 0
        if images:
            return span_of(prompt, (await vision_prompt(tokenizer, text, list(images), scope.tenant))[0])
        return span_of(prompt, await tokenizer.encode_rendered(text, scope.tenant))

    lead = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system = await without(messages[lead:], tools) if lead else (0, 0)
    tool_span = await without(messages, None) if tools else (0, 0)
    wide = prompt and max(prompt) >= IMAGE_KEY_BASE  # image keys (backends/vision/keys.py) take 64 bits
    return Fingerprint(scope, model, array("Q" if wide else "I", prompt), system, tool_span)
