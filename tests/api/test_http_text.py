"""Text over HTTP from scripted model output: stop strings, whole characters, keep-alives, failures.

The scripted backend (tests/scripted_backend.py) emits chosen tokens, so each
test knows exactly what text the model "writes".
"""

from __future__ import annotations

import asyncio

import pytest

from http_daemon import data_frames, serving, sse_events
from scripted_backend import EOS, ScriptedBackend
from kvfork.server.text.tokenizer import PromptTokenizer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "say it"}]
REPLY = "héllo 🎉 wörld STOP more text"


def replying(tokenizer: PromptTokenizer, text: str, fail_after: int | None = None) -> ScriptedBackend:
    """A backend whose answer to MESSAGES is `text`, then EOS (or a failure after `fail_after` tokens)."""
    prompt = tokenizer.encode_chat(MESSAGES, None, {})
    reply = tokenizer.encode_text(text)

    def script(sequence) -> int:
        k = len(sequence) - len(prompt)
        return reply[k] if 0 <= k < len(reply) else EOS

    def fails(kind: str, sessions, inputs) -> bool:
        return kind == "decode" and any(s.tokens[:len(prompt)] == prompt and s.position >= len(prompt) + fail_after
                                        for s in sessions)

    backend = ScriptedBackend(script=script)
    if fail_after is not None:
        backend.fail = fails
    return backend


def deltas(frames: list) -> list[str]:
    return [f["choices"][0]["delta"].get("content", "") for f in frames[1:-1] if "choices" in f and f["choices"]]


async def test_reply_ends_at_eos_with_whole_characters(tiny_model_dir, tokenizer, http):
    async with serving(tiny_model_dir("llama"), replying(tokenizer, REPLY)) as d:
        async with http.post(d.url + CHAT, json={"messages": MESSAGES, "stream": True}) as r:
            frames = data_frames(await sse_events(r))
        pieces = deltas(frames)
        assert "".join(pieces) == REPLY and frames[-2]["choices"][0]["finish_reason"] == "stop"
        assert len(tokenizer.encode_text("🎉")) > 1  # the emoji spans tokens, yet no piece splits it
        assert not any("\ufffd" in p for p in pieces)


async def test_stop_string_is_cut_and_never_streamed(tiny_model_dir, tokenizer, http):
    assert len(tokenizer.encode_text(" STOP")) > 1  # split over tokens
    async with serving(tiny_model_dir("llama"), replying(tokenizer, REPLY)) as d:
        body = {"messages": MESSAGES, "stop": ["STOP", "never"], "max_tokens": 50}
        async with http.post(d.url + CHAT, json=body) as r:
            whole = await r.json()
        assert whole["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "héllo 🎉 wörld "},
                                       "finish_reason": "stop", "logprobs": None}
        async with http.post(d.url + CHAT, json={**body, "stream": True}) as r:
            frames = data_frames(await sse_events(r))
        pieces = deltas(frames)
        assert "".join(pieces) == "héllo 🎉 wörld "
        assert not any(p and "STOP".startswith(p.strip()) and p.strip() for p in pieces)
        assert frames[-2]["choices"][0]["finish_reason"] == "stop"
        async with http.post(d.url + "/v1/completions",
                             json={"prompt": tokenizer.encode_chat(MESSAGES, None, {}), "stop": "wörld"}) as r:
            assert (await r.json())["choices"][0]["text"] == "héllo 🎉 "


async def test_keep_alive_comments_during_a_long_prefill(tiny_model_dir, tokenizer, http):
    backend = replying(tokenizer, "ok")
    backend.delay["prefill"] = 0.5
    async with serving(tiny_model_dir("llama"), backend, sse_keepalive=0.05) as d:
        async with http.post(d.url + CHAT, json={"messages": MESSAGES, "stream": True}) as r:
            lines = await sse_events(r)
    first_content = next(i for i, line in enumerate(lines) if '"delta":{"content"' in line)
    assert lines[0].startswith("data: ") and '"role":"assistant"' in lines[0]
    assert ": keep-alive" in lines[1:first_content]
    assert "".join(deltas(data_frames(lines))) == "ok"


async def test_a_failing_request_reports_an_error_and_spares_the_others(tiny_model_dir, tokenizer, http):
    async with serving(tiny_model_dir("llama"), replying(tokenizer, REPLY, fail_after=3)) as d:
        async def failing() -> list:
            async with http.post(d.url + CHAT, json={"messages": MESSAGES, "stream": True}) as r:
                return data_frames(await sse_events(r))

        async def other() -> dict:  # another prompt, the script never fails it; decoded in the same steps
            body = {"messages": [{"role": "user", "content": "something else"}], "max_tokens": 20, "ignore_eos": True}
            async with http.post(d.url + CHAT, json=body) as r:
                assert r.status == 200
                return await r.json()

        frames, spared = await asyncio.gather(failing(), other())
        assert frames[-1] == "[DONE]" and frames[-2]["error"]["code"] == "engine_error"
        assert "".join(deltas(frames[:-1])) and all("error" not in f for f in frames[:-2])
        assert spared["usage"]["completion_tokens"] == 20
        async with http.post(d.url + CHAT, json={"messages": MESSAGES}) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "engine_error"
        async with http.get(d.url + "/health") as r:
            assert r.status == 200
