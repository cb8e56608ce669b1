"""The bench's client and runner against the OpenAI test double (tests/openai_double.py), in process."""

from __future__ import annotations

import io

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from openai_double import Double, make_app, parse_args
from kvfork.tools.bench.client import Target
from kvfork.tools.bench.runner import replay
from kvfork.tools.bench.workload import Call, Options, Workload, build


async def _serve(app: web.Application):
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def double(tiny_model_dir):
    """A base URL factory: double(reuse=K) serves the tiny llama model's tokenizer."""
    servers = []

    async def start(reuse: int = 0, decode_s: float = 0.002):
        args = parse_args(["--model", tiny_model_dir("llama"), "--port", "0", "--decode-s", str(decode_s),
                           "--active-prefix-reuse-min-tokens", str(reuse)])
        d = Double(args)
        servers.append(await _serve(make_app(d)))
        return f"http://127.0.0.1:{servers[-1].port}", d

    yield start
    for s in servers:
        await s.close()


async def test_records_timing_usage_and_text(double):
    url, _ = await double()
    wl = build("burst", Options(n=3, prefix_tokens=200, max_tokens=(5, 5)))
    result = await replay(wl, Target(url), logprobs=True, progress_out=io.StringIO())
    assert result.wall_s > 0
    for rec in result.records:
        assert rec.ok, rec.error
        assert 0 < rec.ttft_s <= rec.e2e_s
        assert rec.output_tokens == 5 and len(rec.tokens) == 5 and len(rec.itl_s) == 4
        assert rec.text == "".join(rec.tokens)
        assert rec.prompt_tokens > 200 and rec.cached_tokens is not None
        assert rec.finish_reason == "length"


async def test_staggered_waits_for_the_previous_first_token_and_reuses(double):
    url, d = await double(reuse=16, decode_s=0.01)
    wl = build("staggered", Options(n=3, prefix_tokens=200, max_tokens=(20, 20)))
    recs = (await replay(wl, Target(url), progress_out=io.StringIO())).records
    recs, tails, warms = recs[:3], recs[3:5], recs[5:]
    ids = [d.chat_ids(c.messages) for c in wl.calls]
    for k, (prev, cur) in enumerate(zip(recs, recs[1:])):
        assert cur.send_s >= prev.send_s + prev.ttft_s
        assert cur.send_s < prev.send_s + prev.e2e_s  # sent while the previous one still decodes
        # The double lets a running request donate: all but the new last message is reused.
        shared = next(i for i, (a, b) in enumerate(zip(ids[k], ids[k + 1])) if a != b)
        assert (cur.prompt_tokens, cur.cached_tokens) == (len(ids[k + 1]), shared)
    # each recipient's tail alone, on the idle server: after every call before it is done
    assert [r.call_id for r in tails] == ["staggered-tail-1", "staggered-tail-2"] and all(r.ok for r in tails)
    assert tails[0].send_s >= max(r.send_s + r.e2e_s for r in recs)
    assert tails[1].send_s >= tails[0].send_s + tails[0].e2e_s
    assert all(tail.prompt_tokens < rec.prompt_tokens / 2 for tail, rec in zip(tails, recs[1:]))  # no prefix
    # then a fresh tail over the shared prefix, each after the one before it, served from the cache
    assert [r.call_id for r in warms] == ["staggered-warm-1", "staggered-warm-2"] and all(r.ok for r in warms)
    assert warms[0].send_s >= tails[1].send_s + tails[1].e2e_s
    assert all(w.cached_tokens >= shared for w in warms)


async def test_root_concurrency_one_runs_sessions_one_after_another(double):
    url, _ = await double()
    wl = build("agentx-mini", Options(scale=0.1, max_tokens=(3, 3)))  # 2 root sessions
    assert wl.root_concurrency == 1 and len(wl.roots) == 2
    recs = (await replay(wl, Target(url), progress_out=io.StringIO())).records
    assert all(r.ok for r in recs)
    spans = {sid: (min(r.send_s for r in recs if r.session == sid),
                   max(r.send_s + r.e2e_s for r in recs if r.session == sid)) for sid in wl.roots}
    (a0, a1), (b0, b1) = sorted(spans.values())
    assert a1 <= b0


async def test_failed_call_still_releases_its_dependents():
    async def refuse(request):
        return web.json_response({"error": {"message": "prompt too long", "type": "invalid_request_error",
                                            "param": "messages", "code": "context_length_exceeded"}}, status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    server = await _serve(app)
    try:
        msgs = [{"role": "user", "content": "hi"}]
        wl = Workload("w", [Call("a", "s", msgs, 4), Call("b", "t", msgs, 4, after="a", on="first_token")])
        out = io.StringIO()
        recs = (await replay(wl, Target(f"http://127.0.0.1:{server.port}"), progress_out=out)).records
    finally:
        await server.close()
    assert [r.error for r in recs] == ["HTTP 400: prompt too long"] * 2
    assert "2/2 done, 0 in flight, 2 failed" in out.getvalue()


async def test_unreachable_server_is_an_error_record():
    wl = Workload("w", [Call("a", "s", [{"role": "user", "content": "hi"}], 4)])
    rec = (await replay(wl, Target("http://127.0.0.1:9"), progress_out=io.StringIO())).records[0]
    assert not rec.ok and "ClientConnectorError" in rec.error
