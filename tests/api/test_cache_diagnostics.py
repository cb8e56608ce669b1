"""Cache diagnostics over HTTP (server/api/diagnosis.py): for each reason, a pair of requests that
produces it, on /v1/messages (Anthropic's `diagnostics`), /v1/responses (OpenAI's
`prompt_cache_diagnostics`) and /v1/chat/completions (the same shape, an extension), streamed and not;
kvfork's own account in `kvfork_cache`; and the reasons counted in /metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from agent_server import agent_model  # noqa: F401 (fixture)
from http_daemon import data_frames, metrics, serving, sse_events, until
from kvfork.server.api.diagnosis import FINGERPRINTS
from kvfork.server.engine.policy.rates import Rates, RateTracker

SYSTEM = "You are a careful coding agent. Read before you write, and test what you change. " * 4
TOOL = {"name": "read_file", "description": "Read a file of the workspace and return its text. " * 3,
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
KEYS = {"Authorization": "Bearer key-a"}


def messages_body(**change) -> dict:
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "system": SYSTEM, "tools": [TOOL],
            "messages": [{"role": "user", "content": "read server.py and find the bug in the cache code"}]}
    return {**body, **change}


async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict, stream: bool,
               headers: dict = KEYS) -> dict:
    """The reply as one body: a stream's frames folded into the fields the tests read."""
    async with http.post(url + path, json={**body, "stream": stream}, headers=headers) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return await r.json()
        frames = [f for f in data_frames(await sse_events(r)) if isinstance(f, dict)]
    out: dict = {}
    for frame in frames:
        kind = frame.get("type", "")
        if kind == "message_start":
            out.update(frame["message"])
        elif kind == "message_delta":
            out.update({k: v for k, v in frame.items() if k == "kvfork_cache"})
        elif kind in ("response.created", "response.completed", "response.incomplete"):
            out.update(frame["response"])
        elif kind == "" and "choices" in frame:  # a chat chunk
            out.setdefault("id", frame["id"])
            for key in ("prompt_cache_diagnostics", "kvfork_cache", "usage"):
                if frame.get(key) is not None:
                    out[key] = frame[key]
    return out


STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
CHANGES = {  # each changes one part of the prompt, and the reason it gives
    "system_changed": dict(system="You are a hasty agent. " + SYSTEM),
    "tools_changed": dict(tools=[{**TOOL, "description": "Read any file. " + TOOL["description"]}]),
    "messages_changed": dict(messages=[{"role": "user", "content": "read app.py and find the bug in the code"}]),
    "model_changed": dict(model="tiny-2"),
}


@pytest.fixture
async def daemon(agent_model):
    async with serving(agent_model, served_model_name=["tiny", "tiny-2"], api_key=["key-a", "key-b"]) as d:
        yield d


@STREAM
async def test_messages_nothing_diverged_is_null_and_the_prefix_was_reused(daemon, http, stream):
    first = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                       stream)
    assert first["diagnostics"] is None and "kvfork_cache" not in first
    again = await post(http, daemon.url, "/v1/messages",
                       messages_body(diagnostics={"previous_message_id": first["id"]}), stream)
    assert again["diagnostics"] is None
    assert again["kvfork_cache"]["state"] == "reused" and again["kvfork_cache"]["reused_tokens"] > 100


@STREAM
@pytest.mark.parametrize("reason", list(CHANGES))
async def test_messages_each_changed_part_is_named(daemon, http, stream, reason):
    first = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                       stream)
    second = await post(http, daemon.url, "/v1/messages",
                        messages_body(diagnostics={"previous_message_id": first["id"]}, **CHANGES[reason]), stream)
    miss = second["diagnostics"]["cache_miss_reason"]
    assert miss["type"] == reason and miss["cache_missed_input_tokens"] > 0
    prompt = first["usage"]["input_tokens"] + first["usage"]["cache_read_input_tokens"]
    account = second["kvfork_cache"]
    if reason == "model_changed":  # one model serves both names: the whole prompt is shared, and reused
        assert miss["cache_missed_input_tokens"] == prompt and account["shared_tokens"] == prompt
    else:  # what the two share is reused; the rest of the first prompt is what the change cost
        assert account["shared_tokens"] + miss["cache_missed_input_tokens"] == prompt
    # a system prompt changed at its first words leaves a few shared tokens, under the cache's minimum
    assert account["state"] == ("below_minimum" if reason == "system_changed" else "reused")


@STREAM
@pytest.mark.parametrize("previous", ["msg_0123456789abcdef01234567", "not an id \u2603", "", "b" * 5000])
async def test_messages_an_unknown_or_malformed_id_is_not_found(daemon, http, stream, previous):
    reply = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": previous}),
                       stream)
    assert reply["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert reply.get("kvfork_cache") is None


@STREAM
async def test_messages_another_tenant_s_id_is_not_found(daemon, http, stream):
    theirs = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                        stream, headers={"Authorization": "Bearer key-b"})
    mine = await post(http, daemon.url, "/v1/messages",
                      messages_body(diagnostics={"previous_message_id": theirs["id"]}), stream)
    assert mine["diagnostics"] == {"cache_miss_reason": {"type": "previous_message_not_found"}}
    assert "shared_tokens" not in json.dumps(mine)


@STREAM
async def test_messages_a_response_made_without_diagnostics_is_unavailable(daemon, http, stream):
    plain = await post(http, daemon.url, "/v1/messages", messages_body(), stream)
    assert "diagnostics" not in plain and "kvfork_cache" not in plain
    reply = await post(http, daemon.url, "/v1/messages",
                       messages_body(diagnostics={"previous_message_id": plain["id"]}), stream)
    assert reply["diagnostics"] == {"cache_miss_reason": {"type": "unavailable"}}


@STREAM
async def test_messages_the_same_prompt_under_another_cache_salt_is_another_scope(daemon, http, stream):
    first = await post(http, daemon.url, "/v1/messages",
                       messages_body(diagnostics={"previous_message_id": None}, cache_salt="a" * 16), stream)
    second = await post(http, daemon.url, "/v1/messages",
                        messages_body(diagnostics={"previous_message_id": first["id"]}, cache_salt="b" * 16), stream)
    assert second["diagnostics"] is None  # the requests are the same; the state was another scope's
    assert second["kvfork_cache"]["state"] == "other_scope" and second["kvfork_cache"]["reused_tokens"] == 0


@STREAM
@pytest.mark.parametrize("engine, state", [(dict(prefix_cache_entries=0), "not_held"),
                                           (dict(prefix_cache_min_tokens=100000), "below_minimum")])
async def test_messages_a_same_prefix_kvfork_did_not_reuse_says_why(agent_model, http, stream, engine, state):
    async with serving(agent_model, served_model_name=["tiny"], engine=engine) as daemon:
        first = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                           stream, headers={})
        second = await post(http, daemon.url, "/v1/messages",
                            messages_body(diagnostics={"previous_message_id": first["id"]}), stream, headers={})
        assert second["diagnostics"] is None and second["kvfork_cache"]["state"] == state
        seen = await metrics(http, daemon.url)
    assert seen['kvfork_cache_diagnoses_total{reason="none"}'] == 1
    assert seen[f'kvfork_cache_diagnosis_states_total{{state="{state}"}}'] == 1


@STREAM
async def test_messages_a_disk_copy_dearer_to_read_than_to_compute_says_so(agent_model, http, stream):
    async with serving(agent_model, served_model_name=["tiny"], engine=dict(prefix_cache_entries=1)) as daemon:
        first = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                           stream, headers={})
        other = messages_body(system="Another agent entirely. " * 12)
        await post(http, daemon.url, "/v1/messages", other, stream, headers={})  # its entry evicts the first's
        await until(lambda: asyncio.sleep(0, daemon.engine.stats().on_disk), lambda n: n >= 1, "the first on disk")
        daemon.engine.rates = RateTracker(prior=Rates(read_bps=1.0))  # a disk far slower than computing
        second = await post(http, daemon.url, "/v1/messages",
                            messages_body(diagnostics={"previous_message_id": first["id"]}), stream, headers={})
    assert second["diagnostics"] is None and second["kvfork_cache"]["state"] == "restore_dearer"


async def test_the_reasons_are_counted_in_metrics(daemon, http):
    first = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                       False)
    for change in CHANGES.values():
        await post(http, daemon.url, "/v1/messages",
                   messages_body(diagnostics={"previous_message_id": first["id"]}, **change), False)
    await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": "nope"}), False)
    seen = await metrics(http, daemon.url)
    for reason in [*CHANGES, "previous_message_not_found"]:
        assert seen[f'kvfork_cache_diagnoses_total{{reason="{reason}"}}'] == 1


# ---- OpenAI's shape: /v1/responses, and /v1/chat/completions' extension ----------------------------

FUNCTION = {"name": TOOL["name"], "description": TOOL["description"], "parameters": TOOL["input_schema"]}
USER = "read server.py and find the bug in the cache code"


def openai_body(api: str, compare: str | None, *, system: str = SYSTEM, tool: dict = FUNCTION, user: str = USER,
                model: str = "tiny", options: bool = True) -> tuple[str, dict]:
    extra = {"prompt_cache_options": {"comparison_response_id": compare}} if options else {}
    if api == "responses":
        return "/v1/responses", {"model": model, "instructions": system, "input": user, "max_output_tokens": 2,
                                 "temperature": 0, "tools": [{"type": "function", **tool}], **extra}
    return "/v1/chat/completions", {
        "model": model, "max_tokens": 2, "temperature": 0, "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "tools": [{"type": "function", "function": tool}], **extra}


def prompt_tokens(reply: dict) -> int:
    usage = reply["usage"]
    return usage.get("input_tokens", usage.get("prompt_tokens"))


OPENAI_CHANGES = {  # the change, and the reason OpenAI's shape names it by
    "input_changed (system)": (dict(system="You are a hasty agent. " + SYSTEM), "input_changed"),
    "tools_changed": (dict(tool={**FUNCTION, "description": "Read any file. " + FUNCTION["description"]}),
                      "tools_changed"),
    "input_changed (messages)": (dict(user="read app.py and find the bug in the code"), "input_changed"),
    "model_changed": (dict(model="tiny-2"), "model_changed"),
}
APIS = pytest.mark.parametrize("api", ["responses", "chat"])


async def openai_pair(http, url, api, stream, first_kwargs=None, headers=KEYS, **second) -> tuple[dict, dict]:
    path, body = openai_body(api, None, **(first_kwargs or {}))
    first = await post(http, url, path, body, stream, headers=headers)
    path, body = openai_body(api, first["id"], **second)
    return first, await post(http, url, path, body, stream)


@STREAM
@APIS
async def test_openai_nothing_diverged_is_a_cache_hit(daemon, http, api, stream):
    first, again = await openai_pair(http, daemon.url, api, stream)
    assert "prompt_cache_diagnostics" not in first  # nothing to compare with: only its fingerprint is kept
    assert again["prompt_cache_diagnostics"] == {"type": "cache_hit"}
    assert again["kvfork_cache"]["state"] == "reused" and again["kvfork_cache"]["reused_tokens"] > 100


@STREAM
@APIS
@pytest.mark.parametrize("case", list(OPENAI_CHANGES))
async def test_openai_each_change_is_a_cache_miss_with_its_reason(daemon, http, api, stream, case):
    change, reason = OPENAI_CHANGES[case]
    first, second = await openai_pair(http, daemon.url, api, stream, **change)
    diagnostics = second["prompt_cache_diagnostics"]
    assert diagnostics["type"] == "cache_miss" and diagnostics["reason"] == reason
    assert diagnostics["comparison_reusable_tokens"] == prompt_tokens(first)
    assert 0 < diagnostics["cache_missed_tokens"] <= prompt_tokens(first)
    assert second["kvfork_cache"]["shared_tokens"] == prompt_tokens(first) - (
        0 if reason == "model_changed" else diagnostics["cache_missed_tokens"])


@STREAM
@APIS
@pytest.mark.parametrize("compare", ["resp_0123456789abcdef", "chatcmpl-nothing", "\u2603" * 3, "c" * 5000])
async def test_openai_an_unknown_or_malformed_id_is_not_found(daemon, http, api, stream, compare):
    path, body = openai_body(api, compare)
    reply = await post(http, daemon.url, path, body, stream)
    assert reply["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    assert "kvfork_cache" not in reply


@STREAM
@APIS
async def test_openai_another_tenant_s_id_is_not_found(daemon, http, api, stream):
    _, mine = await openai_pair(http, daemon.url, api, stream, headers={"Authorization": "Bearer key-b"})
    assert mine["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    assert "kvfork_cache" not in mine


@STREAM
@APIS
async def test_openai_a_response_made_without_options_is_unavailable(daemon, http, api, stream):
    path, body = openai_body(api, None, options=False)
    plain = await post(http, daemon.url, path, body, stream)
    assert "prompt_cache_diagnostics" not in plain and "kvfork_cache" not in plain
    path, body = openai_body(api, plain["id"])
    reply = await post(http, daemon.url, path, body, stream)
    assert reply["prompt_cache_diagnostics"] == {"type": "unavailable"}


async def test_refused_requests_store_nothing_and_a_tenant_evicts_its_own_first(daemon, http):
    """Issue 45: fingerprints are stored once the engine admits a request, and past the store's bound the
    tenant holding the most gives up its oldest: key-a's refused and many requests never evict key-b's."""
    fingerprints = daemon.app[FINGERPRINTS]
    theirs = await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}),
                        False, headers={"Authorization": "Bearer key-b"})
    held = fingerprints.kept.total
    fingerprints.kept.limit = 3 * held  # room for three fingerprints of this size
    context = daemon.state.context
    too_long = messages_body(messages=[{"role": "user", "content": "word " * context}],
                             diagnostics={"previous_message_id": None})  # the engine refuses it
    for _ in range(4):
        async with http.post(daemon.url + "/v1/messages", json=too_long, headers=KEYS) as r:
            assert r.status == 400, await r.text()
    assert fingerprints.kept.total == held
    for _ in range(4):  # key-a's own: past the bound, its oldest go
        await post(http, daemon.url, "/v1/messages", messages_body(diagnostics={"previous_message_id": None}), False)
    asked = messages_body(diagnostics={"previous_message_id": theirs["id"]})
    again = await post(http, daemon.url, "/v1/messages", asked, False, headers={"Authorization": "Bearer key-b"})
    assert again["diagnostics"] is None and again["kvfork_cache"]["state"] == "reused"
