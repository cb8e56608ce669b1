"""`kvfork serve --distributed` on 2 ranks over HTTP: reuse on, the same answers as one process, and
the faults (a rank killed mid-stream, with and without a launcher; a stalled rank; shutdown).

torch serves the tiny llama; MLX the tiny qwen3_5 (a hybrid mlx-lm splits: its recurrent state
checkpoints travel with every clone, on each rank's shard).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvfork.backends import create_backend
from distributed_harness import (DISTRIBUTED_BACKENDS, KV_BUDGET, METRICS_KEY, REPO, by_hand, free_ports,
                                 launched, log_text, logprob_bound, rank_env, stop_group)
from http_daemon import TEST_ENGINE, data_frames, serving

pytestmark = pytest.mark.distributed

ENGINE = dict(TEST_ENGINE, active_prefix_reuse_min_tokens=16)
FLAGS = ["--dtype", "float32", "--kv-budget-bytes", KV_BUDGET, "--inference-slots", "4",
         "--prefix-cache-min-tokens", "16", "--active-prefix-reuse-min-tokens", "16", "--shutdown-grace", "2"]
SYSTEM = " ".join(["the shared agent system prompt for every tool call and file read"] * 6)


@pytest.fixture(params=DISTRIBUTED_BACKENDS)
def backend_name(request) -> str:
    if request.param == "mlx":
        pytest.importorskip("mlx_lm")  # a GPU machine's check has torch alone
    return request.param


@pytest.fixture
def model(backend_name, tiny_model_dir, tiny_hybrid_dir) -> str:
    return tiny_model_dir("llama") if backend_name == "torch" else tiny_hybrid_dir("qwen3_5", "hf")


def serve_command(name: str, model: str, port: int, *extra: str) -> list[str]:
    return ["-m", "kvfork.server.cli", "serve", "--distributed", "--backend", name, "--model", model, "--port", str(port),
            *FLAGS, *extra]


async def healthy(url: str, proc_logs: list[Path], limit_s: float = 300) -> None:
    deadline = asyncio.get_running_loop().time() + limit_s
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert asyncio.get_running_loop().time() < deadline, "\n".join(log_text(p)[-3000:] for p in proc_logs)
            await asyncio.sleep(0.25)


def chat(user: str, system: str = SYSTEM, max_tokens: int = 12, **extra) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": 0, "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 2, **extra}


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def workload(url: str) -> dict[str, dict]:
    """Active reuse (a prompt sharing a running request's prefix), a cancel, the prefix cache, a named
    session's second turn and two requests sent together; each reply as JSON, by name."""
    out = {}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions",
                             json=chat("first question", max_tokens=3000, ignore_eos=True, stream=True)) as donor:
            assert donor.status == 200
            await donor.content.readline()  # its first token is out: it runs, its prompt computed
            out["beside a running request"] = await post(http, url, chat("second question"))
        out["the same again"] = await post(http, url, chat("second question"))
        first = await post(http, url, chat("third question", session_id="s1"))
        out["a session's first turn"] = first
        reply = first["choices"][0]["message"]["content"]
        body = chat("third question", session_id="s1")
        body["messages"] += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then"}]
        out["its second turn"] = await post(http, url, body)
        pair = await asyncio.gather(*(post(http, url, chat("fourth", system=SYSTEM + " together")) for _ in range(2)))
        out["sent together (1)"], out["sent together (2)"] = pair
    return out


def assert_same_reply(got: dict, want: dict, what: str, allowed: float) -> None:
    """Token by token while the one-process run's top-2 margin exceeds `allowed` (logprob_bound): the
    same token, its logprob within it. Past a near tie the runs may rightly part: the comparison stops there."""
    got_tokens, want_tokens = (r["choices"][0]["logprobs"]["content"] for r in (got, want))
    for g, w in zip(got_tokens, want_tokens):
        assert abs(g["logprob"] - w["logprob"]) <= allowed, what
        top = sorted((t["logprob"] for t in w["top_logprobs"]), reverse=True)
        if len(top) > 1 and top[0] - top[1] <= allowed:
            return
        assert g["token"] == w["token"], what
    assert len(got_tokens) == len(want_tokens), what


async def test_two_ranks_answer_as_one_process_with_reuse_on(backend_name, model, tmp_path):
    """Under the launcher; then SIGTERM (torchrun forwards it to every rank; under mlx.launch, to rank 0
    alone): rank 0 shuts down and its Stop takes rank 1 out."""
    port = free_ports(1)
    log = tmp_path / "launch.log"
    proc = launched(backend_name, serve_command(backend_name, model, port), rank_env(backend_name, tmp_path), log)
    try:
        url = f"http://127.0.0.1:{port}"
        await healthy(url, [log])
        got = await workload(url)
        async with aiohttp.ClientSession() as http, \
                http.get(url + "/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}) as r:
            metrics = await r.text()
    finally:
        if proc.poll() is None:
            if backend_name == "torch":
                proc.send_signal(signal.SIGTERM)
            else:  # mlx.launch forwards no signal (a terminal's Ctrl-C reaches every rank itself)
                os.kill(int(re.search(r"rank 0 of 2, pid (\d+)", log_text(log)).group(1)), signal.SIGTERM)
        try:
            proc.wait(120)
        finally:
            stop_group(proc)
    assert "stopped with rank 0 (rank 0 shut down)" in log_text(log)
    assert re.search(r"kvfork_clone_successes_total\{[^}]*\} [1-9]", metrics), "no clone ran on the ranks"
    async with serving(model, create_backend(backend_name), engine=ENGINE, dtype="float32") as daemon:
        want = await workload(daemon.url)
    for what in want:
        assert_same_reply(got[what], want[what], what, logprob_bound(model))
    assert cached(got["beside a running request"]) >= 16
    for what in ("the same again", "its second turn"):  # a hybrid's named session resumes where one process does
        assert cached(got[what]) == cached(want[what]), what


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


async def stream_until_error(url: str, fault) -> list:
    """A long stream; `fault()` once its first tokens are out; every data frame until it ends."""
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions",
                             json=chat("a long answer", max_tokens=3000, ignore_eos=True, stream=True)) as r:
            assert r.status == 200
            lines = [await r.content.readline() for _ in range(4)]
            fault()
            lines += [line async for line in r.content]
    return data_frames([line.decode().rstrip("\n") for line in lines if line.strip()])


async def health(url: str) -> tuple[int, str]:
    """/health as the metrics key's holder reads it (why the runner stopped), after checking that a reader
    without the key is told only that it stopped."""
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as r:
            assert r.status == 503 and "the model runner has stopped" in await r.text()
        async with http.get(url + "/health", headers={"Authorization": f"Bearer {METRICS_KEY}"}) as r:
            return r.status, await r.text()


# How rank 0 learns that rank 1 died mid-stream: gloo's collective fails at once; MLX's ring sometimes waits on
# the dead peer instead (one kill in six on a quiet machine, 2026-12-08), until --rank-timeout ends the step
DEAD_PEER = {"torch": ("rank 1 failed or was lost",),
             "mlx": ("rank 1 failed or was lost", "rank 1 stopped answering")}


async def test_rank_1_killed_mid_stream_without_a_launcher(backend_name, model, tmp_path):
    """Rank 0 survives a dead peer: the stream ends with an error naming rank 1, /health names it (to the
    metrics key's holder), new requests get a 503; it still stops on SIGTERM."""
    port = free_ports(1)
    rank0, rank1 = by_hand(backend_name, serve_command(backend_name, model, port, "--rank-timeout", "10"),
                           rank_env(backend_name, tmp_path), tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        await healthy(url, [tmp_path / "rank0.log", tmp_path / "rank1.log"])
        frames = await stream_until_error(url, rank1.kill)
        said = frames[-2]["error"]["message"]
        assert any(reason in said for reason in DEAD_PEER[backend_name]), frames[-2:]
        status, text = await health(url)
        assert status == 503 and "rank 1" in text, text
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/chat/completions", json=chat("after")) as r:
                assert r.status == 503 and "the model runner has stopped" in await r.text()
        assert rank0.poll() is None, "rank 0 left with its peer"
        rank0.send_signal(signal.SIGTERM)
        assert rank0.wait(60) == 0, log_text(tmp_path / "rank0.log")[-2000:]
    finally:
        for proc in (rank0, rank1):
            stop_group(proc)


async def test_rank_1_killed_mid_stream_under_the_launcher(backend_name, model, tmp_path):
    """The launcher SIGTERMs rank 0 once rank 1 is gone: the stream still ends with an error, not a
    dropped connection, and every rank leaves."""
    port = free_ports(1)
    log = tmp_path / "launch.log"
    proc = launched(backend_name, serve_command(backend_name, model, port), rank_env(backend_name, tmp_path), log)
    try:
        url = f"http://127.0.0.1:{port}"
        await healthy(url, [log])
        rank1 = int(re.search(r"rank 1 of 2 \(pid (\d+)\)", log_text(log)).group(1))
        frames = await stream_until_error(url, lambda: os.kill(rank1, signal.SIGKILL))
        assert frames[-1] == "[DONE]" and "error" in frames[-2], frames[-2:]
        proc.wait(120)
    finally:
        stop_group(proc)


async def test_stalled_rank_caught_by_the_watchdog(backend_name, model, tmp_path):
    """A rank that stops answering (SIGSTOP) without its connections closing: rank 0's watchdog ends
    the stream past --rank-timeout and /health names the rank (to the metrics key's holder)."""
    port = free_ports(1)
    rank0, rank1 = by_hand(backend_name, serve_command(backend_name, model, port, "--rank-timeout", "3"),
                           rank_env(backend_name, tmp_path), tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        await healthy(url, [tmp_path / "rank0.log", tmp_path / "rank1.log"])
        frames = await stream_until_error(url, lambda: rank1.send_signal(signal.SIGSTOP))
        assert "rank 1 stopped answering" in frames[-2]["error"]["message"], frames[-2:]
        status, text = await health(url)
        assert status == 503 and "rank 1 stopped answering" in text
    finally:
        for proc in (rank1, rank0):
            stop_group(proc)


def test_without_a_launcher_it_says_how_to_start(backend_name, model, tmp_path):
    env = {k: v for k, v in rank_env(backend_name, tmp_path).items() if k not in ("RANK", "MLX_RANK")}
    done = subprocess.run([sys.executable, *serve_command(backend_name, model, free_ports(1))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    launcher = "torchrun" if backend_name == "torch" else "mlx.launch"
    assert done.returncode == 1 and f"--distributed: start every rank with {launcher}" in done.stderr, done.stderr


def test_a_model_that_cannot_split_stops_every_rank_with_the_reason(backend_name, tmp_path):
    """The default model's shape (9 heads, 3 KV heads): rank 0 and rank 1 both exit 1, saying why."""
    from tiny_models import write_model

    folder = write_model(tmp_path / "nine", "llama", hidden_size=144, intermediate_size=384, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=16)
    procs = by_hand(backend_name, serve_command(backend_name, str(folder), free_ports(1)),
                    rank_env(backend_name, tmp_path), tmp_path)
    try:
        codes = [proc.wait(240) for proc in procs]
    finally:
        for proc in procs:
            stop_group(proc)
    reason = "9 attention heads, 3 KV heads: not a multiple of 2"
    assert codes == [1, 1]
    assert reason in log_text(tmp_path / "rank0.log") and reason in log_text(tmp_path / "rank1.log")


async def test_rank_0_killed_the_others_leave(backend_name, model, tmp_path):
    """No rank keeps running alone: rank 1, waiting for a plan, finds rank 0 gone and leaves, saying so."""
    port = free_ports(1)
    rank0, rank1 = by_hand(backend_name, serve_command(backend_name, model, port), rank_env(backend_name, tmp_path),
                           tmp_path)
    try:
        await healthy(f"http://127.0.0.1:{port}", [tmp_path / "rank0.log", tmp_path / "rank1.log"])
        rank0.kill()
        assert rank1.wait(120) == 1
        assert "kvfork: rank 1: leaving:" in log_text(tmp_path / "rank1.log")
    finally:
        for proc in (rank0, rank1):
            stop_group(proc)
