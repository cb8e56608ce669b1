"""One streamed chat completion against any OpenAI-compatible server, timed.

Times come from the client's monotonic clock: what an agent would feel. Token
counts come from the server's usage chunk (`stream_options.include_usage`);
`cached_tokens` is `usage.prompt_tokens_details.cached_tokens` where the server
reports it (kvfork, mlx_lm.server, llama.cpp's server).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp


@dataclass
class Record:
    call_id: str
    session: str
    tag: str
    send_s: float = 0.0  # offset from the run's start
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None
    text: str = ""
    tokens: list[str] = field(default_factory=list)  # per-token text, when logprobs were asked for
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Target:
    base_url: str  # e.g. http://127.0.0.1:8080 (the /v1 is added here)
    model: str | None = None  # None: leave the field out; the server picks its model
    api_key: str | None = None
    timeout_s: float = 900.0  # per request, reading included
    routing_key: bool = False  # send each call's session as x-smg-routing-key (a gateway's sticky sessions)


def request_body(messages: list[dict], max_tokens: int, model: str | None, logprobs: bool = False,
                 ignore_eos: bool = True) -> dict:
    # ignore_eos (vLLM's name; kvfork and llama.cpp take it) makes every server
    # generate the same number of tokens, so passes compare like with like.
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if logprobs:
        body["logprobs"] = True
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def _apply_chunk(rec: Record, chunk: dict, now: float, t0: float, last: list[float], on_first: Callable | None):
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens", rec.cached_tokens)
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        content = delta.get("content") or ""
        lp = (choice.get("logprobs") or {}).get("content") or []
        rec.tokens += [entry.get("token", "") for entry in lp]
        if content or lp:
            if rec.ttft_s is None:
                rec.ttft_s = now - t0
                if on_first:
                    on_first()
            else:
                rec.itl_s.append(now - last[0])
            last[0] = now
            rec.text += content
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]


async def stream_chat(
    http: aiohttp.ClientSession,
    target: Target,
    rec: Record,
    body: dict,
    run_t0: float,
    on_first_token: Callable[[], None] | None = None,
) -> Record:
    """Send `body`, fill `rec` as chunks arrive; errors land in `rec.error`, never raise."""
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    if target.routing_key:
        headers["x-smg-routing-key"] = rec.session
    url = target.base_url.rstrip("/") + "/v1/chat/completions"
    t0 = time.monotonic()
    rec.send_s = t0 - run_t0
    last = [t0]
    try:
        timeout = aiohttp.ClientTimeout(total=target.timeout_s)
        async with http.post(url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {_error_message(await resp.text())}"
                return rec
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and keep-alive comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {_error_message(data)}"
                    break
                _apply_chunk(rec, chunk, time.monotonic(), t0, last, on_first_token)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.e2e_s = time.monotonic() - t0
    if rec.error is None and rec.ttft_s is None:
        rec.ttft_s = rec.e2e_s  # nothing streamed (an immediate stop): the answer came at the end
    return rec


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error")
        return err.get("message", str(err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return text[:200]
