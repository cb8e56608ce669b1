"""The scripted proxy between a client and kvfork: it records what the client sends, steers the
tiny random model where it cannot choose for itself, and counts what kvfork answers.

Steering is the documented test-only mechanism of `kvfork clients`: it never touches the client,
only the requests on their way to kvfork, with kvfork's own constrained decoding.
- Turn 1 asks to read notes.txt. While no tool result has come back, a request that offers the
  client's read tool gets `tool_choice` naming it, and that tool's schema (in every request, so
  the prompt stays the one the other turns share) admits exactly the scripted arguments: the model
  can write nothing else, so no model-made argument ever reaches a tool.
- The subagent step (Claude Code) asks, in its own turn, for two subagents: while fewer tool results
  than subagents have come back, a request that offers the Agent tool gets `tool_choice` naming it, and
  its schema admits exactly the next subagent's description and prompt (the calls differ, so the Agent
  tool's schema is the one place the main agent's requests of that turn differ).
- Every other request gets a JSON-schema output that admits one short reply, `{"reply": "done"}`,
  and `tool_choice: none`, so a reply ends cleanly instead of running to its limit (a subagent's too).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

TURN = "KVFORK-TURN-"
END_SCHEMA = {"type": "object", "properties": {"reply": {"type": "string", "enum": ["done"]}},
              "required": ["reply"], "additionalProperties": False}
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


SUBAGENT = "cc_is_subagent=true;"  # in the billing line of a Claude Code subagent's request


@dataclass(frozen=True)
class ScriptedCall:
    """One of the client's tools and the one call the script lets the model make to it."""

    name: str
    arguments: dict[str, str]

    def schema(self) -> dict[str, Any]:
        return {"type": "object", "additionalProperties": False, "required": list(self.arguments),
                "properties": {k: {"type": "string", "enum": [v]} for k, v in self.arguments.items()}}


@dataclass(frozen=True)
class Subagents:
    """The subagents the script has Claude Code start with its Agent tool, one after the other, in the
    turn numbered `turn`: one prompt each."""

    turn: int
    prompts: tuple[str, ...]

    def next_call(self, api: str, body: dict) -> ScriptedCall | None:
        """The Agent call this request of the main agent must make, if any is left."""
        text = _conversation(api, body)
        mark = f"{TURN}{self.turn}"
        if mark not in text:
            return None
        started = text[text.rindex(mark):].count('"tool_result"')
        if started >= len(self.prompts):
            return None
        return ScriptedCall("Agent", {"description": f"subagent {started + 1}", "prompt": self.prompts[started]})


@dataclass
class Tally:
    """What one client's run saw, counted from kvfork's answers."""

    requests: int = 0
    tool_calls: int = 0
    cached_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    forced_calls: int = 0
    messages: list[tuple[bool, int, int]] = field(default_factory=list)  # each Messages answer: (a subagent's, prompt, cached)


def _conversation(api: str, body: dict) -> str:
    items = body.get("input") if api == "responses" else body.get("messages")
    return json.dumps(items if items is not None else [])


def _wants_call(api: str, body: dict) -> bool:
    """Turn 1 is the latest scripted turn and no tool result has come back since it."""
    text = _conversation(api, body)
    turns = [int(text[i + len(TURN)]) for i in range(len(text)) if text.startswith(TURN, i)]
    if not turns or max(turns) != 1:
        return False
    after = text[text.rindex(TURN + "1"):]
    return not any(marker in after for marker in ('"function_call_output"', '"tool_result"', '"role": "tool"'))


def _tool_name(api: str, tool: dict) -> str | None:
    if api == "chat":
        return (tool.get("function") or {}).get("name")
    return tool.get("name")


def _force(api: str, body: dict, call: ScriptedCall, wanted: bool) -> bool:
    """Give `call`'s tool its scripted schema where `body` offers it; with `wanted`, name it in
    `tool_choice`. True when the call is forced."""
    offered = False
    for tool in body.get("tools") or []:
        if _tool_name(api, tool) != call.name:
            continue
        offered = True
        if api == "chat":
            tool["function"]["parameters"] = call.schema()
        elif api == "messages":
            tool["input_schema"] = call.schema()
        else:
            tool["parameters"] = call.schema()
    if offered and wanted:
        body["tool_choice"] = {"messages": {"type": "tool", "name": call.name},
                               "chat": {"type": "function", "function": {"name": call.name}},
                               "responses": {"type": "function", "name": call.name}}[api]
        return True
    return False


def steer(api: str, body: dict, read: ScriptedCall, subagents: Subagents | None = None) -> bool:
    """Rewrite `body` in place; True when it forces a call (the read, or starting a subagent)."""
    tools = body.get("tools") or []
    if _force(api, body, read, _wants_call(api, body)):
        return True
    start = subagents.next_call(api, body) if subagents is not None else None
    if start is not None and _force(api, body, start, True):
        return True
    if api == "messages":
        body["output_config"] = {"format": {"type": "json_schema", "schema": END_SCHEMA}}
        if tools:
            body["tool_choice"] = {"type": "none"}
    elif api == "chat":
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "reply", "schema": END_SCHEMA, "strict": True}}
        if tools:
            body["tool_choice"] = "none"
    else:
        body["text"] = {**(body.get("text") or {}),
                        "format": {"type": "json_schema", "name": "reply", "schema": END_SCHEMA, "strict": True}}
        if tools:
            body["tool_choice"] = "none"
    return False


def api_of(path: str) -> str | None:
    if path.startswith("/v1/messages") and "count_tokens" not in path:
        return "messages"
    if path.startswith("/v1/chat/completions"):
        return "chat"
    if path.startswith("/v1/responses"):
        return "responses"
    return None


def _objects(raw: bytes) -> list[dict]:
    """The JSON bodies of an answer: the whole body, or each SSE data frame."""
    text = raw.decode(errors="replace")
    try:
        whole = json.loads(text)
        return [whole] if isinstance(whole, dict) else []
    except ValueError:
        pass
    out = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                out.append(json.loads(line[5:]))
            except ValueError:
                continue
    return out


def count(api: str, status: int, raw: bytes, tally: Tally, subagent: bool = False) -> None:
    """Add one answer's tool calls, cached tokens and errors to `tally` (a Messages answer's prompt and
    cached tokens to its list too)."""
    if status >= 400:
        tally.errors.append(f"{api} {status}: {raw[:200].decode(errors='replace')}")
        return
    if api == "messages":
        usage = next((o["usage"] for o in _objects(raw) if o.get("type") in ("message_delta", "message")), {})
        cached = usage.get("cache_read_input_tokens", 0)
        tally.messages.append((subagent, usage.get("input_tokens", 0) + cached, cached))
    for obj in _objects(raw):
        kind = obj.get("type", "")
        if kind == "error" or (kind == "" and "error" in obj):
            tally.errors.append(f"{api}: {json.dumps(obj)[:200]}")
        elif api == "responses" and kind in ("response.completed", "response.incomplete", "response"):
            response = obj.get("response", obj)
            tally.tool_calls += sum(1 for item in response.get("output", ()) if item.get("type") == "function_call")
            usage = response.get("usage") or {}
            tally.cached_tokens += (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        elif api == "messages" and kind in ("message_delta", "message"):
            tally.cached_tokens += (obj.get("usage") or {}).get("cache_read_input_tokens", 0)
            if kind == "message":
                tally.tool_calls += sum(1 for block in obj.get("content", ()) if block.get("type") == "tool_use")
        elif api == "messages" and kind == "content_block_start":
            tally.tool_calls += (obj.get("content_block") or {}).get("type") == "tool_use"
        elif api == "chat":
            for choice in obj.get("choices") or ():
                message = choice.get("delta") or choice.get("message") or {}
                tally.tool_calls += sum(1 for call in message.get("tool_calls") or () if call.get("id"))
            if obj.get("usage"):
                tally.cached_tokens += (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


class Proxy:
    """Listens on a loopback port and forwards to `upstream` (kvfork), steering and counting."""

    def __init__(self, upstream: str, read: ScriptedCall, record: Path | None = None,
                 subagents: Subagents | None = None):
        self.upstream, self.read, self.record, self.subagents = upstream.rstrip("/"), read, record, subagents
        self.tally = Tally()
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=None))
        return self.url

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.runner is not None:
            await self.runner.cleanup()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        api = api_of(request.path)
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        self._record(request, body if body is not None else raw.decode(errors="replace"))
        forced = subagent = False
        if api is not None and isinstance(body, dict):
            subagent = api == "messages" and SUBAGENT in json.dumps(body.get("system"))
            forced = steer(api, body, self.read, self.subagents)
            raw = json.dumps(body).encode()
            self.tally.requests += 1
            self.tally.forced_calls += forced
        # the body goes on decoded (aiohttp inflated it): without the client's Content-Encoding
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
        assert self.session is not None
        async with self.session.request(request.method, self.upstream + request.path_qs, data=raw or None,
                                        headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS and key.lower() != "content-encoding":
                    response.headers[key] = value
            await response.prepare(request)
            seen = bytearray()
            async for chunk in upstream.content.iter_any():
                seen += chunk
                await response.write(chunk)
            await response.write_eof()
        if api is not None:
            count(api, upstream.status, bytes(seen), self.tally, subagent)
        return response

    def _record(self, request: web.Request, body: Any) -> None:
        if self.record is None:
            return
        entry = {"at": time.time(), "method": request.method, "path": request.path_qs,
                 "headers": dict(request.headers), "body": body}
        with self.record.open("a") as out:
            out.write(json.dumps(entry) + "\n")
