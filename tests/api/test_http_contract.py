"""The OpenAI contract over real HTTP on a tiny MLX model: shapes, streaming order, usage, reuse, sessions."""

from __future__ import annotations

import pytest

from http_daemon import chat_body, data_frames, metrics, serving, sse_events

LONG = "the prefix cache of the server holds the shared prompt of every agent request " * 3


@pytest.fixture
async def daemon(tiny_model_dir):
    async with serving(tiny_model_dir("llama"), served_model_name=["tiny", "tiny-alias"]) as d:
        yield d


async def post(http, url, body, headers=None) -> tuple[int, dict]:
    async with http.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def stream(http, url, body) -> list:
    async with http.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return data_frames(await sse_events(r))


async def test_chat_completion_shape_and_usage(daemon, http):
    status, body = await post(http, daemon.url + "/v1/chat/completions", chat_body(max_tokens=5, ignore_eos=True))
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "tiny" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_stream_order_role_deltas_finish_usage_done(daemon, http):
    request = chat_body(max_tokens=6, ignore_eos=True)
    frames = await stream(http, daemon.url + "/v1/chat/completions",
                          {**request, "stream_options": {"include_usage": True}})
    assert frames[-1] == "[DONE]"
    role, *deltas, finish, usage, _ = frames
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(f["object"] == "chat.completion.chunk" and f["id"] == role["id"] for f in frames[:-1])
    assert deltas and all(f["choices"][0]["finish_reason"] is None and "content" in f["choices"][0]["delta"]
                          for f in deltas)
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    # the streamed text is the non-streamed text
    _, whole = await post(http, daemon.url + "/v1/chat/completions", request)
    assert "".join(f["choices"][0]["delta"]["content"] for f in deltas) == whole["choices"][0]["message"]["content"]


async def test_no_usage_chunk_unless_asked(daemon, http):
    frames = await stream(http, daemon.url + "/v1/chat/completions", chat_body(max_tokens=3))
    assert frames[-1] == "[DONE]" and all(f["choices"] for f in frames[:-1])


async def test_cached_tokens_report_prefix_cache_reuse(daemon, http):
    url = daemon.url + "/v1/chat/completions"
    _, first = await post(http, url, chat_body(LONG, max_tokens=2))
    _, second = await post(http, url, chat_body(LONG, max_tokens=2))
    frames = await stream(http, url, {**chat_body(LONG, max_tokens=2), "stream_options": {"include_usage": True}})
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # the last prompt token always runs through the model: all but one are reused
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    assert frames[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1
    seen = await metrics(http, daemon.url)
    assert seen['kvfork_reused_tokens_total{source="cache"}'] == 2 * (prompt - 1)


async def test_chat_logprobs(daemon, http):
    _, body = await post(http, daemon.url + "/v1/chat/completions",
                         chat_body(max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3))
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the top one, of one log-softmax


async def test_completions_text_and_token_ids_agree(daemon, http):
    url = daemon.url + "/v1/completions"
    text_prompt = {"prompt": "the capital of France is", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    _, by_text = await post(http, url, text_prompt)
    ids = daemon.state.tokenizer.encode_text("the capital of France is")
    _, by_ids = await post(http, url, {**text_prompt, "prompt": ids})
    _, batch_of_one = await post(http, url, {**text_prompt, "prompt": [ids]})
    assert by_text["object"] == "text_completion" and by_text["id"].startswith("cmpl-")
    assert by_text["choices"][0]["text"] == by_ids["choices"][0]["text"] == batch_of_one["choices"][0]["text"]
    assert by_text["usage"]["prompt_tokens"] == len(ids) and by_text["usage"]["completion_tokens"] == 5
    _, echoed = await post(http, url, {**text_prompt, "echo": True})
    assert echoed["choices"][0]["text"] == "the capital of France is" + by_text["choices"][0]["text"]


async def test_completions_logprobs_and_stream(daemon, http):
    url = daemon.url + "/v1/completions"
    request = {"prompt": "the city", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    _, body = await post(http, url, {**request, "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(top) <= 2 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    frames = await stream(http, url, {**request, "stream_options": {"include_usage": True}})
    *pieces, finish, usage, done = frames
    assert done == "[DONE]" and usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert finish["choices"][0]["finish_reason"] == "length"
    assert "".join(p["choices"][0]["text"] for p in pieces) == body["choices"][0]["text"]


async def test_models_names_and_aliases(daemon, http):
    async with http.get(daemon.url + "/v1/models") as r:
        listed = await r.json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == ["tiny", "tiny-alias"]
    assert all(m["object"] == "model" and m["max_model_len"] == 4096 for m in listed["data"])
    status, body = await post(http, daemon.url + "/v1/chat/completions", chat_body(model="tiny-alias", max_tokens=1))
    assert status == 200 and body["model"] == "tiny-alias"


async def test_health_and_metrics(daemon, http):
    async with http.get(daemon.url + "/health") as r:
        assert r.status == 200 and (await r.json())["status"] == "ok"
    await post(http, daemon.url + "/v1/chat/completions", chat_body(max_tokens=2, ignore_eos=True))
    async with http.get(daemon.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for family in ("kvfork_http_requests_total", "kvfork_prompt_tokens_total", "kvfork_reused_tokens_total",
                   "kvfork_prefilled_tokens_total", "kvfork_generated_tokens_total",
                   "kvfork_time_to_first_token_seconds_bucket", "kvfork_inter_token_seconds_bucket",
                   "kvfork_queue_depth", "kvfork_live_sessions", "kvfork_prefix_cache_entries",
                   "kvfork_prefix_cache_bytes", "kvfork_prefix_cache_hits_total", "kvfork_prefix_cache_queries_total",
                   "kvfork_prefix_cache_admissions_total", "kvfork_num_requests_running", "kvfork_num_requests_waiting",
                   "kvfork_clone_attempts_total", "kvfork_clone_successes_total", "kvfork_clone_refusals_total"):
        assert family in text
    seen = await metrics(http, daemon.url)
    assert seen['kvfork_http_requests_total{route="/v1/chat/completions",status="200"}'] == 1
    assert seen["kvfork_generated_tokens_total"] == 2


async def test_named_session_resumes_warm_then_reset_and_delete(daemon, http):
    url = daemon.url + "/v1/chat/completions"
    history = [{"role": "user", "content": LONG}]
    _, first = await post(http, url, {"messages": history, "max_tokens": 3, "temperature": 0, "session_id": "s-1"})
    history += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "and the next city"}]
    _, warm = await post(http, url, {"messages": history, "max_tokens": 3, "temperature": 0},
                         headers={"X-Kvfork-Session": "s-1"})
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    status, reset = await post(http, daemon.url + "/v1/sessions/s-1/reset", None)
    assert status == 200 and reset == {"id": "s-1", "object": "session", "reset": True}
    _, cold = await post(http, url, {"messages": history, "max_tokens": 3, "temperature": 0, "session_id": "s-1"})
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"]
    async with http.delete(daemon.url + "/v1/sessions/s-1") as r:
        assert r.status == 200 and (await r.json())["deleted"] is True
    async with http.delete(daemon.url + "/v1/sessions/s-1") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "session_not_found"


async def test_cached_tokens_report_active_reuse_from_a_running_request(tiny_model_dir, http):
    system = {"role": "system", "content": LONG}
    async with serving(tiny_model_dir("llama"), engine=dict(prefix_cache_entries=0,
                                                            active_prefix_reuse_min_tokens=1,
                                                            speculative="off")) as d:
        donor = {"messages": [system, {"role": "user", "content": "a"}], "max_tokens": 3000, "ignore_eos": True,
                 "stream": True, "temperature": 0}
        async with http.post(d.url + "/v1/chat/completions", json=donor) as running:
            async for line in running.content:  # the donor is decoding: its whole prompt is committed
                if b'"content":"' in line and b'"role"' not in line:
                    break
            _, recipient = await post(http, d.url + "/v1/chat/completions",
                                      chat_body(max_tokens=2) | {"messages": [system, {"role": "user", "content": "b"}]})
            running.close()
        donor_ids = d.state.tokenizer.encode_chat(donor["messages"], None, {})
        own_ids = d.state.tokenizer.encode_chat([system, {"role": "user", "content": "b"}], None, {})
        shared = next(i for i, (a, b) in enumerate(zip(donor_ids, own_ids)) if a != b)
        assert recipient["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
        seen = await metrics(http, d.url)
        assert seen['kvfork_reused_tokens_total{source="donor"}'] == shared
