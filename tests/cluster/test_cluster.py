"""`kvfork cluster`: two replicas of a tiny model behind a real smg, end to end. One test, one cluster (it
takes a few seconds to start): bearer keys through the gateway, /v1/loads read with keys set, stored state
that lives on one replica, a replica killed mid-stream and started again, and one stopped and brought back
with its disk tier. Skips when smg is not installed (pip install '.[cluster]'); CI installs it."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import pytest

from http_daemon import until as wait_until

pytestmark = pytest.mark.skipif(importlib.util.find_spec("smg") is None,
                                reason="smg is not installed: pip install '.[cluster]'")

KEY = "cluster-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
PROMPT = "a shared system prompt that every call of this agent sends before its question, word for word " * 3
START_S = 90.0  # generous bounds for a loaded CI machine: waits, never timings
END_S = 30.0


def free_base_port(span: int) -> int:
    """A port P such that P .. P + span - 1 are all free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + span >= 65535:
            continue
        try:
            for port in range(base, base + span):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def readable(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # a process that ended meanwhile
        return b""


def pid_listening_on(port: int) -> int:
    """The replica serving `port`: the `kvfork serve` process whose command line names it."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kvfork.server" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(entry.name)
    raise LookupError(f"no replica on port {port}")


class Cluster:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc, self.lines = proc, []
        self.seen = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())
            self.seen.set()

    async def line(self, pattern: str, after: int = 0) -> re.Match:
        """The first output line from index `after` on that matches `pattern`, waiting for it."""
        async def find():
            while True:
                for text in self.lines[after:]:
                    if m := re.search(pattern, text):
                        return m
                if self.proc.returncode is not None and self.reader.done():
                    raise AssertionError(f"the cluster exited before {pattern!r}:\n" + "\n".join(self.lines[-20:]))
                self.seen.clear()
                await self.seen.wait()
        return await asyncio.wait_for(find(), START_S)


async def get_json(http: aiohttp.ClientSession, url: str, **kw):
    """(status, body); (0, None) while nothing listens there (a replica starting again)."""
    try:
        async with http.get(url, **kw) as r:
            return r.status, await r.json(content_type=None)
    except aiohttp.ClientConnectionError:
        return 0, None


async def until(read, check, what: str):
    return await wait_until(read, check, what, limit_s=START_S)


async def running(http, url: str) -> int:
    _, body = await get_json(http, url + "/v1/loads")
    return body["loads"][0]["num_running_reqs"]


async def chat(http, url: str, text: str, headers=AUTH, **extra) -> tuple[int, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 3, "temperature": 0,
            **extra}
    async with http.post(url + CHAT, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.long  # smg and two replica processes, each loading its model
async def test_two_replicas_behind_smg(tiny_model_dir, tmp_path):
    port = free_base_port(4)
    gateway, replicas = f"http://127.0.0.1:{port}", [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvfork.server.cli", "cluster", "--replicas", "2", "--port", str(port),
        "--model", tiny_model_dir("llama"), "--backend", "torch", "--served-model-name", "tiny",
        "--kv-budget-bytes", "256MiB", "--prefix-cache-min-tokens", "16", "--shutdown-grace", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "KVFORK_HOME": str(tmp_path), "KVFORK_API_KEY": KEY})
    cluster = Cluster(proc)
    try:
        await cluster.line(rf"^gateway: {re.escape(gateway)}$")
        assert [(await cluster.line(rf"^replica {i}: (\S+)$")).group(1) for i in (1, 2)] == replicas
        # one KV budget, split; a disk tier each
        assert all((tmp_path / "cluster" / f"replica-{i}" / "kv").is_dir() for i in (1, 2))
        # the key reaches the replicas in their environment: no command line on this machine holds it
        for url in replicas:
            pid = pid_listening_on(int(url.rsplit(":", 1)[1]))
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert not [p for p in Path("/proc").glob("[0-9]*/cmdline") if KEY.encode() in readable(p)]
        async with aiohttp.ClientSession() as http:
            # Bearer keys pass through smg to the replicas, which check them (smg drops x-api-key)
            status, body = await chat(http, gateway, "hello", headers={})
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            status, body = await chat(http, gateway, "hello")
            assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
            # smg's control plane is closed; its key is the operator's, in a 0600 file
            key_file = tmp_path / "cluster" / "control-plane-key"
            assert oct(key_file.stat().st_mode & 0o777) == "0o600"
            control = {"Authorization": f"Bearer {key_file.read_text().strip()}"}
            async with http.get(gateway + "/workers") as r:
                assert r.status == 401
            async with http.post(gateway + "/workers", json={"url": "http://127.0.0.1:9"}) as r:
                assert r.status == 401  # no rogue worker registers
            # smg reads /v1/loads (open, keys or not) from both replicas
            loads = await until(lambda: get_json(http, gateway + "/get_loads", headers=control),
                                lambda r: len([w for w in r[1]["loads"] if w.get("max_total_num_tokens", 0) > 0]) == 2,
                                "both replicas' loads at the gateway")
            assert {w["worker"] for w in loads[1]["loads"]} == set(replicas)

            # stored state lives on one replica: a sticky routing key keeps a conversation there ...
            sticky = {**AUTH, "x-smg-routing-key": "conversation-1"}
            first = {"model": "tiny", "input": PROMPT, "max_output_tokens": 3}
            async with http.post(gateway + "/v1/responses", json=first, headers=sticky) as r:
                assert r.status == 200
                response_id = (await r.json())["id"]
            follow_up = {"model": "tiny", "input": "and then?", "max_output_tokens": 3,
                         "previous_response_id": response_id}
            async with http.post(gateway + "/v1/responses", json=follow_up, headers=sticky) as r:
                assert r.status == 200, await r.text()
            owners = [url for url in replicas
                      if (await get_json(http, f"{url}/v1/responses/{response_id}", headers=AUTH))[0] == 200]
            assert len(owners) == 1
            other = next(url for url in replicas if url not in owners)
            # ... and another replica answers its id with a 404 in OpenAI's shape, never a 500
            async with http.post(other + "/v1/responses", json=follow_up, headers=AUTH) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "previous_response_not_found"
            # a named session there is a new one: computed again, not an error
            status, body = await chat(http, owners[0], PROMPT, session_id="agent-7")
            assert status == 200
            status, body = await chat(http, other, PROMPT, session_id="agent-7")
            assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

            # a replica killed mid-stream: the stream ends (an error or a closed connection), never hangs
            before = len(cluster.lines)
            long = {"model": "tiny", "messages": [{"role": "user", "content": "count on"}], "max_tokens": 3000,
                    "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as streaming:
                response = await streaming.post(gateway + CHAT, json=long,
                                                headers={**AUTH, "x-smg-routing-key": "conversation-2"})
                assert response.status == 200
                await response.content.readline()
                busy = await until(lambda: asyncio.gather(*(running(http, url) for url in replicas)),
                                   lambda counts: sum(counts) == 1, "the stream running on one replica")
                victim = replicas[busy.index(1)]
                os.kill(pid_listening_on(int(victim.rsplit(":", 1)[1])), signal.SIGKILL)

                async def drain():
                    try:
                        async for _ in response.content:
                            pass
                    except aiohttp.ClientPayloadError:
                        pass  # the connection closed mid-body: a clean end for a client

                await asyncio.wait_for(drain(), END_S)
            # new requests go to the survivor (smg retries one sent to the dead replica, or its checks took it out)
            for i in range(3):
                status, _ = await chat(http, gateway, f"after the crash {i}")
                assert status == 200
            # the cluster starts it again, and smg takes it back
            index = replicas.index(victim) + 1
            await cluster.line(rf"replica {index} exited \(code -9\); starting it again", after=before)
            await cluster.line(rf"^\[replica {index}\] kvfork: loaded", after=before)
            await until(lambda: get_json(http, gateway + "/workers", headers=control),
                        lambda r: [w["is_healthy"] for w in r[1]["workers"]] == [True, True], "both healthy again")

            # a replica stopped (SIGTERM: its prefix cache spills to disk) comes back with its prefixes
            survivor = other if other != victim else owners[0]
            status, _ = await chat(http, survivor, PROMPT + " the tier")
            assert status == 200
            before = len(cluster.lines)
            os.kill(pid_listening_on(int(survivor.rsplit(":", 1)[1])), signal.SIGTERM)
            index = replicas.index(survivor) + 1
            await cluster.line(rf"replica {index} exited \(code 0\); starting it again", after=before)
            await until(lambda: get_json(http, survivor + "/health"), lambda r: r[0] == 200, "restarted")
            status, body = await chat(http, survivor, PROMPT + " the tier")
            assert status == 200
            async with http.get(survivor + "/metrics") as r:
                text = await r.text()
            found = sum(float(v) for v in re.findall(r"^kvfork_prefix_cache_disk_decisions_total\{[^}]*\} (\S+)$",
                                                       text, re.M))
            assert found >= 1, "the restarted replica's disk tier did not know the prompt"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: everything stops
        code = await asyncio.wait_for(proc.wait(), END_S + 30)
        await cluster.reader
    assert code == 0, "\n".join(cluster.lines[-20:])
    assert not any(f"--port\0{port + i}\0".encode() in _cmdlines() for i in (1, 2))


def _cmdlines() -> bytes:
    out = b""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out += (entry / "cmdline").read_bytes() + b"\n"
            except OSError:
                pass
    return out
