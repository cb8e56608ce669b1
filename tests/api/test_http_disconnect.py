"""Clients that hang up free their slot; concurrent requests decode in shared steps. Real HTTP, tiny MLX model."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from http_daemon import chat_body, first_token, metrics, serving, until

CHAT = "/v1/chat/completions"
LONG_RUN = 3000  # tokens: far more than the test lets a request run, so only a cancel can end it early
CANCELLED = 'kvfork_requests_total{finish_reason="cancelled"}'


async def test_disconnect_mid_stream_cancels_and_frees_the_slot(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), engine=dict(inference_slots=1)) as d:
        read = lambda: metrics(http, d.url)  # noqa: E731
        async with aiohttp.ClientSession() as client:
            response = await client.post(d.url + CHAT, json=chat_body(max_tokens=LONG_RUN, ignore_eos=True, stream=True))
            await first_token(response)
            assert (await read())["kvfork_running_requests"] == 1
            response.close()  # the client goes away mid-stream
        seen = await until(read, lambda m: m.get(CANCELLED) == 1 and m["kvfork_running_requests"] == 0,
                           "the stream cancelled")
        assert seen["kvfork_generated_tokens_total"] < LONG_RUN
        assert seen['kvfork_http_requests_total{route="/v1/chat/completions",status="499"}'] == 1
        # the one slot is free again
        async with http.post(d.url + CHAT, json=chat_body(max_tokens=2)) as r:
            assert r.status == 200


async def test_disconnect_while_queued_and_while_decoding_non_streaming(tiny_model_dir, http):
    async with serving(tiny_model_dir("llama"), engine=dict(inference_slots=1)) as d:
        read = lambda: metrics(http, d.url)  # noqa: E731
        long = chat_body(max_tokens=LONG_RUN, ignore_eos=True)

        async def hang_up_when(check, what):
            """A non-streaming request whose client leaves once `check` holds on the metrics."""
            client = aiohttp.ClientSession()
            call = asyncio.create_task(client.post(d.url + CHAT, json=long))
            await until(read, check, what)
            call.cancel()
            await client.close()

        # the first non-streaming request holds the only slot, decoding ...
        running = aiohttp.ClientSession()
        holder = asyncio.create_task(running.post(d.url + CHAT, json=long))
        await until(read, lambda m: m["kvfork_running_requests"] == 1 and m["kvfork_generated_tokens_total"] == 0
                    and m["kvfork_runner_steps_total"] > 0, "the first request running")
        # ... a second waits in the queue, and its client leaves mid-wait
        await hang_up_when(lambda m: m["kvfork_queue_depth"] == 1, "a queued request")
        seen = await until(read, lambda m: m.get(CANCELLED) == 1 and m["kvfork_queue_depth"] == 0, "queued cancel")
        assert seen["kvfork_running_requests"] == 1  # the first one is untouched
        # now the first one's client leaves mid-decode
        holder.cancel()
        await running.close()
        seen = await until(read, lambda m: m.get(CANCELLED) == 2 and m["kvfork_running_requests"] == 0,
                           "decoding cancel")
        assert seen["kvfork_generated_tokens_total"] < LONG_RUN
        async with http.post(d.url + CHAT, json=chat_body(max_tokens=2)) as r:
            assert r.status == 200


async def test_concurrent_requests_decode_in_shared_steps(tiny_model_dir, http):
    prompts = ["the capital of France", "a river in Germany", "open the file and read", "the next long city"]
    async with serving(tiny_model_dir("llama"), engine=dict(inference_slots=4)) as d:
        async def ask(text: str) -> str:
            async with http.post(d.url + CHAT, json=chat_body(text, max_tokens=40, ignore_eos=True)) as r:
                return (await r.json())["choices"][0]["message"]["content"]

        alone = [await ask(p) for p in prompts]
        before = await metrics(http, d.url)
        together = await asyncio.gather(*(ask(p) for p in prompts))
        after = await metrics(http, d.url)
    steps = after["kvfork_runner_steps_total"] - before["kvfork_runner_steps_total"]
    generated = after["kvfork_generated_tokens_total"] - before["kvfork_generated_tokens_total"]
    assert generated == 160
    assert steps < generated / 2  # one at a time would take a step per token
    assert list(together) == alone  # batching does not change what each request gets


async def test_hanging_up_mid_stream_is_quiet_and_counted(tiny_model_dir, http, caplog):
    """Whether the hang-up cancels the handler or breaks a write, nothing is logged as an error."""
    async with serving(tiny_model_dir("llama")) as d:
        for n in range(1, 6):
            async with aiohttp.ClientSession() as client:
                response = await client.post(d.url + CHAT, json=chat_body(max_tokens=LONG_RUN, ignore_eos=True,
                                                                        stream=True))
                for _ in range(n * 5):
                    await response.content.readline()
                response.close()
        seen = await until(lambda: metrics(http, d.url),
                           lambda m: m.get(CANCELLED) == 5 and m["kvfork_running_requests"] == 0, "5 cancels")
    assert seen['kvfork_http_requests_total{route="/v1/chat/completions",status="499"}'] == 5
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
