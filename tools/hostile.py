"""The hostile-tenant wave: one tenant attacks, another works, and the other must not notice.

Two tenants share a daemon run in this process (an API keys file names them). The innocent one
first measures its time to first token alone, stores a response and opens a named session. Then,
shape by shape, the hostile one sends what issue 22's review sent (several at once, again and again)
while the innocent one keeps measuring:

    stops       300,000 stop strings on chat (over OpenAI's 4), and Anthropic's cap of long ones, run
    nested      a body nested 20,000 deep in a field nobody reads
    template    a chat template of its own in chat_template_kwargs
    schema      a response_format of thousands of optional properties (compiles past the timeout)
    prompt      a message just under the characters cap, over the context (refused on its prefix)
    reader      a stream of 8 choices with 20 top logprobs that it never reads
    slowloris   connections with half a request head, and bodies that never finish
    hoard       more stored responses and named sessions than its quota
    auth        keys that are not UTF-8
    hog         (issue 33) every inference slot and the whole queue, with generations it keeps coming
    flood       a torrent of the cheapest refusal, an empty body (a 400 each)
    badkeys     a torrent of wrong keys (a 401 each), against a daemon of 100,000 keys
    ids         /v1/completions with 3 million token ids and echo
    trickle     a large reply read a kilobyte a second
    inflate     zstd and gzip bodies of kilobytes that inflate to gigabytes, far past --max-body-bytes
    models      requests naming another model than the innocent's, on a daemon of two models where
                one fits: each switch would unload the innocent's model
    images      images in tool results: a decompression bomb's header, bytes no image, a BMP, a URL on no
                allowed domain, more than --max-images, a data URL past the body limit, and screenshots

The hostile tenant runs in a process of its own (`--attack SHAPE`), as a real one would: in the
daemon's process its own work (encoding 4 MB bodies) would be measured as the daemon's. The several-models
shapes (`SEVERAL`) run on a second daemon, of two models (`main`, the innocent's, and `other`) of which one
fits, against the innocent's solo TTFT measured there. It sends
little generation (a few tokens): sharing the model's compute is fair; what is measured is whether
a cheap request can make the daemon do expensive or unbounded work.

Checks (kvfork soak adds them to its table):
- the innocent tenant's TTFT, the median over each shape, stays within max(2x solo, solo + 0.5 s):
  a bare 2x would flap on a 2-core machine where solo is 20 ms;
- every request of the innocent tenant is answered (none refused, cancelled or cut off);
- the innocent tenant's stored response and named session survive;
- no response has status 500 (as the clients saw them, and as the daemon counted them);
- every hostile request is refused or bounded (a 4xx, a 200 of bounded work, or its connection closed),
  and the slow connections were closed and counted.

`python -m kvfork.tools.hostile` runs it alone and prints the per-shape table (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import gzip
import json
import socket
import statistics
import struct
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp

from kvfork.server.generate.isolated import module_command

CHAT, COMPLETIONS, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"
HOSTILE, INNOCENT = "key-hostile", "key-innocent"
KEYS = f"{HOSTILE} hostile\n{INNOCENT} innocent\n"
ALLOWED = {200, 400, 401, 404, 408, 409, 413, 429}  # refused or bounded; None: its connection was closed
TCP_ESTABLISHED = 1  # tcp_info's first byte
SYSTEM = ("You are a careful assistant for a team of engineers. Answer briefly, cite the file you read, "
          "and never invent an API. ") * 45  # past the tokenizer's off-loop threshold: it takes the worker


@dataclass
class HostileConfig:
    model: str
    backend: str = "auto"
    concurrency: int = 4  # hostile requests in flight at once, per shape (SERIAL shapes: one)
    innocent_samples: int = 5  # TTFTs measured alone, and during each shape
    timeouts_s: float = 2.0  # --header-timeout, --body-timeout, --write-timeout
    compile_timeout_s: float = 2.0
    max_stored_responses: int = 4
    max_named_sessions: int = 3


@dataclass
class ShapeResult:
    name: str
    solo: list[float]  # the innocent's TTFTs alone, on the daemon the shape ran on
    ttfts: list[float] = field(default_factory=list)
    statuses: list[int | None] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # the innocent's requests not answered, and why

    @property
    def median(self) -> float:
        return statistics.median(self.ttfts) if self.ttfts else float("nan")

    @property
    def bound(self) -> float:
        return ttft_bound(statistics.median(self.solo))


def ttft_bound(solo_median: float) -> float:
    return max(2 * solo_median, solo_median + 0.5)


@dataclass
class WaveOutcome:
    solo: list[float]
    shapes: list[ShapeResult]
    survived: dict[str, bool]
    metrics: dict[str, float]

    @property
    def solo_median(self) -> float:
        return statistics.median(self.solo)

    @property
    def bound(self) -> float:
        return ttft_bound(self.solo_median)


@dataclass
class AttackTarget:
    """What the hostile process knows of the daemon it attacks."""

    url: str
    port: int
    max_stop_chars: int
    max_stop_sequences: int
    prompt_chars: int
    max_body_bytes: int
    timeouts_s: float
    max_stored_responses: int
    max_named_sessions: int


class Ctx:
    def __init__(self, http: aiohttp.ClientSession, target: AttackTarget):
        self.http, self.target = http, target
        self.url, self.port = target.url, target.port
        self._encoded: dict[str, bytes] = {}

    def encoded(self, name: str, make: Callable[[], Any]) -> bytes:
        """A body encoded once (see the module docstring)."""
        if name not in self._encoded:
            body = make()
            self._encoded[name] = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self._encoded[name]

    def headers(self, key: str = HOSTILE) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async def post(self, path: str, body: Any, key: str = HOSTILE, coding: str | None = None) -> int:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**self.headers(key), "Content-Type": "application/json",
                   **({"Content-Encoding": coding} if coding else {})}
        async with self.http.post(self.url + path, data=data, headers=headers) as r:
            await r.read()
            return r.status


async def raw(port: int, data: bytes, hold_s: float) -> int | None:
    """Send raw bytes and wait (bounded) for the daemon to answer or close: the status, or None (closed, a reset
    too)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(hold_s):
            reply = await reader.read()
        return int(reply.split()[1]) if reply.startswith(b"HTTP/1.1 ") else None
    except ConnectionError:
        return None
    except TimeoutError:
        return -1  # still open: the check says so
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):  # retrieves a reset, which the stream also keeps for wait_closed
            await writer.wait_closed()


# ---- the shapes ----


async def shape_stops(ctx: Ctx) -> list[int | None]:
    over = ctx.encoded("stops-over", lambda: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                              "stop": [f"s{i}" for i in range(300_000)]})
    at = ctx.encoded("stops-at", lambda: {
        "messages": [{"role": "user", "content": "Write a story."}], "max_tokens": 12,
        "stop_sequences": [f"{i:04d}" + "q" * (ctx.target.max_stop_chars - 4)
                           for i in range(ctx.target.max_stop_sequences)]})
    return [await ctx.post(CHAT, over), await ctx.post(MESSAGES, at)]


async def shape_nested(ctx: Ctx) -> list[int | None]:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    return [await ctx.post(CHAT, body)]


async def shape_template(ctx: Ctx) -> list[int | None]:
    loop = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}x"
    return [await ctx.post(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                  "chat_template_kwargs": {"chat_template": loop}})]


async def shape_schema(ctx: Ctx) -> list[int | None]:
    wide = ctx.encoded("schema", lambda: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                          "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                              "schema": {"type": "object", "properties": {
                                                  f"p{i}": {"type": "string"} for i in range(4000)}}}}})
    nonce = str(time.monotonic_ns()).encode()  # a new grammar each time: nothing cached
    return [await ctx.post(CHAT, wide.replace(b'"p0"', b'"p' + nonce + b'"', 1))]


async def shape_prompt(ctx: Ctx) -> list[int | None]:
    chars = min(ctx.target.prompt_chars, ctx.target.max_body_bytes // 2) - 1000
    return [await ctx.post(CHAT, ctx.encoded("prompt", lambda: {
        "messages": [{"role": "user", "content": "ab " * (chars // 3)}], "max_tokens": 4}))]


async def shape_reader(ctx: Ctx) -> list[int | None]:
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me everything."}], "n": 8, "stream": True,
                       "logprobs": True, "top_logprobs": 20, "max_tokens": 2000, "ignore_eos": True}).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {HOSTILE}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", ctx.port))
        await loop.sock_sendall(sock, head + body)
        # never read; wait until the daemon gives up on it (bounded)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != TCP_ESTABLISHED:
                return [None]  # the daemon closed it
        return [-1]
    finally:
        sock.close()


async def shape_slowloris(ctx: Ctx) -> list[int | None]:
    hold = ctx.target.timeouts_s * 4 + 10  # lingering after a 401 takes up to 10 s in aiohttp
    head = raw(ctx.port, f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bea".encode(), hold)
    body = raw(ctx.port, (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {HOSTILE}\r\n"
                          "Content-Type: application/json\r\nContent-Length: 16000000\r\n\r\n{").encode(), hold)
    anonymous = raw(ctx.port, (f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\n"
                               "Content-Length: 16000000\r\n\r\n{").encode(), hold)
    return list(await asyncio.gather(head, body, anonymous))


async def shape_hoard(ctx: Ctx) -> list[int | None]:
    out = []
    for i in range(ctx.target.max_stored_responses + 2):
        out.append(await ctx.post(RESPONSES, {"input": "x", "max_output_tokens": 1}))
    for i in range(ctx.target.max_named_sessions + 2):
        out.append(await ctx.post(CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                         "session_id": f"hoard-{time.monotonic_ns()}-{i}"}))
    return out


async def shape_auth(ctx: Ctx) -> list[int | None]:
    return [await raw(ctx.port, f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer ".encode() +
                      b"\xff\xfe\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", 30)]


async def shape_hog(ctx: Ctx) -> list[int | None]:
    return [await ctx.post(CHAT, {"messages": [{"role": "user", "content": "Count."}], "max_tokens": 8,
                                  "ignore_eos": True})]


async def shape_models(ctx: Ctx) -> list[int | None]:
    return [await ctx.post(CHAT, {"model": "other", "messages": [{"role": "user", "content": "Count."}],
                                  "max_tokens": 8, "ignore_eos": True}),
            await ctx.post(CHAT, {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})]


async def shape_flood(ctx: Ctx) -> list[int | None]:
    return [await ctx.post(CHAT, b"{}")]


async def shape_badkeys(ctx: Ctx) -> list[int | None]:
    return [await ctx.post(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, key=f"k{time.monotonic_ns()}")]


async def shape_ids(ctx: Ctx) -> list[int | None]:
    return [await ctx.post(COMPLETIONS, ctx.encoded("ids", lambda: b'{"prompt": [' + b"1," * 3_000_000 +
                                                          b'1], "echo": true, "max_tokens": 1}'))]


async def shape_trickle(ctx: Ctx) -> list[int | None]:
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me everything."}], "n": 4, "stream": True,
                       "logprobs": True, "top_logprobs": 20, "max_tokens": 500, "ignore_eos": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel holds little of the reply for it
    sock.connect(("127.0.0.1", ctx.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    try:
        writer.write((f"POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {HOSTILE}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not await reader.read(1024):
                return [None]  # the daemon cut it off (or it ended): bounded either way
            await asyncio.sleep(1.0)
        return [-1]
    except ConnectionError:
        return [None]
    finally:
        writer.close()


async def shape_inflate(ctx: Ctx) -> list[int | None]:
    from kvfork.server.api.content_encoding import zstd

    spaces = b" " * (2 * ctx.target.max_body_bytes)  # twice the limit: packed, a few kilobytes
    # zstd: 64 frames of them, 2 GiB at the default limit, from a few hundred kilobytes; gzip (1,000 to 1) one
    frames = ctx.encoded("inflate-zstd", lambda: zstd().compress(spaces) * 64)
    member = ctx.encoded("inflate-gzip", lambda: gzip.compress(spaces, compresslevel=9))
    return [await ctx.post(CHAT, frames, coding="zstd"), await ctx.post(MESSAGES, member, coding="gzip")]


def _tool_result(*urls: str) -> dict[str, Any]:
    """A chat turn whose tool result holds images (a text-only model decodes them to describe them)."""
    call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    return {"messages": [{"role": "user", "content": "look"}, {"role": "assistant", "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1",
                          "content": [{"type": "image_url", "image_url": {"url": url}} for url in urls]}],
            "max_tokens": 2}


def _png(width: int, height: int, rows: bytes = b"") -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    head = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))  # 8-bit grey
    return b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


async def shape_images(ctx: Ctx) -> list[int | None]:
    bodies = {
        # 100,000 x 100,000 pixels claimed: refused by its header, never decoded
        "bomb": lambda: _tool_result(_data_url(_png(100_000, 100_000))),
        "noise": lambda: _tool_result(_data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64)),
        "bmp": lambda: _tool_result(_data_url(b"BM" + bytes(4096), "image/bmp")),
        "url": lambda: _tool_result("https://attacker.example/track.png"),
        "count": lambda: _tool_result(*[_data_url(_png(8, 8, bytes(8 * 9)))] * 5000),
        "body": lambda: _tool_result("data:image/png;base64," + "A" * ctx.target.max_body_bytes),
        # four 1280x800 screenshots, flat grey: decoded, hashed and described, bounded by their pixels
        "shots": lambda: _tool_result(*[_data_url(_png(1280, 800, bytes(800 * 1281)))] * 4),
    }
    return [await ctx.post(CHAT, ctx.encoded(f"images-{name}", make)) for name, make in bodies.items()]


SERIAL = {"reader", "hoard", "trickle"}  # one at a time: the reader's 8 choices take half the slots, the hoard is a count
SHAPES: dict[str, Callable[[Ctx], Awaitable[list[int | None]]]] = {
    "stops": shape_stops, "nested": shape_nested, "template": shape_template, "schema": shape_schema,
    "prompt": shape_prompt, "reader": shape_reader, "slowloris": shape_slowloris, "hoard": shape_hoard,
    "auth": shape_auth, "hog": shape_hog, "flood": shape_flood, "badkeys": shape_badkeys, "ids": shape_ids,
    "trickle": shape_trickle, "inflate": shape_inflate, "models": shape_models, "images": shape_images,
}
SEVERAL = {"models"}  # on the daemon of two models
WIDE = {"hog": 48, "flood": 32, "badkeys": 32}  # in flight at once: past the slots and the queue, a torrent


# ---- the innocent tenant ----


async def innocent_ttft(ctx: Ctx, i: int) -> float:
    """One streamed chat of the innocent tenant: seconds from sending to its first token."""
    body = {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Question {i}: which file holds the parser?"}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    async with ctx.http.post(ctx.url + CHAT, json=body, headers=ctx.headers(INNOCENT)) as r:
        if r.status != 200:
            raise RuntimeError(f"the innocent tenant got {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            choice = (json.loads(line[6:])["choices"] or [{}])[0]
            delta = choice.get("delta", {})
            if delta.get("content") or choice.get("finish_reason"):
                ttft = time.monotonic() - t0
                break
        else:
            raise RuntimeError("the innocent tenant's stream ended without a token")
        await r.read()
    return ttft


async def innocent_keeps(ctx: Ctx) -> str:
    """A stored response and a named session of the innocent tenant; returns the response's id."""
    async with ctx.http.post(ctx.url + RESPONSES, json={"input": "remember this", "max_output_tokens": 2},
                             headers=ctx.headers(INNOCENT)) as r:
        rid = (await r.json())["id"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "session_id": "innocent-session"}
    async with ctx.http.post(ctx.url + CHAT, json=body, headers=ctx.headers(INNOCENT)) as r:
        await r.read()
    return rid


async def innocent_survived(ctx: Ctx, rid: str) -> dict[str, bool]:
    async with ctx.http.get(f"{ctx.url}{RESPONSES}/{rid}", headers=ctx.headers(INNOCENT)) as r:
        response = r.status == 200
    async with ctx.http.post(ctx.url + "/v1/sessions/innocent-session/reset", headers=ctx.headers(INNOCENT)) as r:
        session = r.status == 200
    return {"stored response": response, "named session": session}


# ---- the wave ----


async def attack(ctx: Ctx, name: str, concurrency: int, samples: int, solo: list[float]) -> ShapeResult:
    """The hostile tenant, in its own process, keeps `concurrency` of the shape in flight while the innocent
    one measures `samples` TTFTs (a request it loses is noted, not measured)."""
    result = ShapeResult(name, solo)
    proc = await asyncio.create_subprocess_exec(
        *module_command("kvfork.tools.hostile", "--attack", name, "--concurrency", str(concurrency),
                        "--target", json.dumps(asdict(ctx.target))),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        await proc.stdout.readline()  # ready
        await asyncio.sleep(0.5)  # let it land
        for i in range(samples):
            try:
                result.ttfts.append(await innocent_ttft(ctx, 1000 + i))
            except (RuntimeError, aiohttp.ClientError) as e:
                result.lost.append(str(e)[:200])
    finally:
        proc.stdin.close()  # stop
        result.statuses = json.loads(await proc.stdout.read() or b"[]")
        await proc.wait()
    return result


async def _attacking(name: str, target: AttackTarget, concurrency: int) -> list[int | None]:
    """The hostile process: the shape, `concurrency` at once, until its stdin closes."""
    statuses: list[int | None] = []
    stopping = False
    async with aiohttp.ClientSession() as http:
        ctx = Ctx(http, target)

        async def hostile() -> None:
            while not stopping:
                try:
                    statuses.extend(await SHAPES[name](ctx))
                except (aiohttp.ClientError, ConnectionError, OSError):
                    statuses.append(None)  # its connection closed under it: bounded

        attackers = [asyncio.create_task(hostile()) for _ in range(concurrency)]
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        stopping = True  # the rounds under way finish (each is bounded): their outcome is the point
        await asyncio.gather(*attackers, return_exceptions=True)
    return statuses


def _server_config(config: HostileConfig, keys: Path, model: Any, **extra: Any):
    from kvfork.server.common.config import ServerConfig

    t = config.timeouts_s
    return ServerConfig(model=model, port=0, host="127.0.0.1", shutdown_grace=1.0, dtype="float32",
                        api_keys_file=str(keys), header_timeout=t, body_timeout=t, write_timeout=t,
                        grammar_compile_timeout=config.compile_timeout_s,
                        max_stored_responses=config.max_stored_responses, **extra)


def _engine_config(config: HostileConfig):
    from kvfork.server.engine.config import EngineConfig

    # 16 slots and a queue of 32: the hog shape fills both (issue 33's finding 8, at --max-queue 32)
    return EngineConfig(inference_slots=16, max_queue=32, max_named_sessions=config.max_named_sessions,
                        prefix_cache_disk_bytes=0)


@contextlib.contextmanager
def _keys_file():
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys"
        keys.write_text(KEYS + "".join(f"key-{i} tenant-{i % 100}\n" for i in range(100_000)))  # badkeys' table
        yield keys


@contextlib.asynccontextmanager
async def hostile_daemon(config: HostileConfig, backend: Any = None):
    from kvfork.server.launch.serve import Daemon, pick_backend

    with _keys_file() as keys:
        if backend is None:
            _, backend = pick_backend(config.backend)
        async with Daemon(_server_config(config, keys, config.model), _engine_config(config), config.model,
                          backend).serving() as d:
            yield d


@contextlib.asynccontextmanager
async def models_daemon(config: HostileConfig):
    """The daemon of two models, `main` (the innocent's, loaded first) and `other`, one loaded at a time."""
    from kvfork.backends import create_backend, default_backend
    from kvfork.server.launch.pool_daemon import PoolDaemon
    from kvfork.server.launch.model_source import model_source
    from kvfork.server.pool.specs import model_specs

    name = default_backend() if config.backend == "auto" else config.backend
    with _keys_file() as keys:
        server = _server_config(config, keys, [f"main={config.model}", f"other={config.model}"],
                                max_loaded_models=1)
        d = PoolDaemon(server, _engine_config(config), model_specs(server.model, None, model_source), name,
                       lambda: create_backend(name))
        await d.listen()
        try:
            await d.load()
            yield d
        finally:
            await d.close()


async def run_wave(config: HostileConfig, backend: Any = None, out=sys.stdout,
                   shapes: list[str] | None = None) -> WaveOutcome:
    """Every shape (or `shapes`): those of one model on its daemon, then the several-models ones on theirs."""
    names = shapes or list(SHAPES)
    one, several = [n for n in names if n not in SEVERAL], [n for n in names if n in SEVERAL]
    outcome = WaveOutcome([], [], {}, {})
    if one:
        async with hostile_daemon(config, backend) as d:
            await _section(d, d.state.context, config, one, outcome, out, keeps=True)
    if several:
        async with models_daemon(config) as d:
            context = d.pool.model(None).served.state.context  # type: ignore[union-attr]  (loaded first)
            await _section(d, context, config, several, outcome, out, keeps=False)
    return outcome


async def _section(d: Any, context: int, config: HostileConfig, names: list[str], outcome: WaveOutcome, out,
                   keeps: bool) -> None:
    """The innocent's solo TTFTs on daemon `d`, then each shape of `names` against them, into `outcome`;
    `keeps`: the innocent's stored response and named session are checked too."""
    from kvfork.tools.bench.serve import parse_metrics

    # the innocent lets an idle connection go before the daemon closes it (--header-timeout): a request sent on
    # one the daemon is closing that instant would fail for the client's reuse of it, not the attack
    connector = aiohttp.TCPConnector(keepalive_timeout=config.timeouts_s / 2)
    async with aiohttp.ClientSession(connector=connector) as http:
        limits = d.config
        target = AttackTarget(d.url, d.port, limits.max_stop_chars, limits.max_stop_sequences,
                              limits.prompt_chars(context), limits.max_body_bytes, config.timeouts_s,
                              config.max_stored_responses, config.max_named_sessions)
        ctx = Ctx(http, target)
        await innocent_ttft(ctx, 0)  # warm: the system prompt's first prefill is no solo sample
        solo = [await innocent_ttft(ctx, 1 + i) for i in range(config.innocent_samples)]
        outcome.solo = outcome.solo or solo
        rid = await innocent_keeps(ctx) if keeps else None
        for name in names:
            concurrency = 1 if name in SERIAL else WIDE.get(name, config.concurrency)
            result = await attack(ctx, name, concurrency, config.innocent_samples, solo)
            outcome.shapes.append(result)
            print(f"hostile: {name}: innocent TTFT median {result.median * 1000:.0f} ms (solo "
                  f"{statistics.median(solo) * 1000:.0f} ms), lost {len(result.lost)}, hostile statuses "
                  f"{sorted(set(map(str, result.statuses)))}", file=out, flush=True)
        if rid is not None:
            outcome.survived = await innocent_survived(ctx, rid)
        async with http.get(d.url + "/metrics") as r:
            for key, value in parse_metrics(await r.text()).items():
                outcome.metrics[key] = outcome.metrics.get(key, 0) + value


def checks(outcome: WaveOutcome) -> list[tuple[str, str, str, bool]]:
    """(name, measured, wanted, ok) rows for the soak's table."""
    rows = []
    worst = max(outcome.shapes, key=lambda s: s.median / s.bound)
    rows.append(("hostile wave: innocent TTFT, median per shape",
                 f"worst {worst.median * 1000:.0f} ms ({worst.name}), "
                 f"solo {statistics.median(worst.solo) * 1000:.0f} ms",
                 f"<= {worst.bound * 1000:.0f} ms (max(2x solo, solo + 0.5 s))",
                 all(s.median <= s.bound for s in outcome.shapes)))
    lost = [f"{shape.name}: {why}" for shape in outcome.shapes for why in shape.lost]
    rows.append(("hostile wave: every request of the innocent tenant answered", f"{len(lost)} lost" +
                 (f" ({lost[0]})" if lost else ""), "0 lost", not lost))
    kept = [k for k, v in outcome.survived.items() if not v]
    rows.append(("hostile wave: the innocent tenant's stored response and session survive",
                 "lost: " + ", ".join(kept) if kept else "both" if outcome.survived else "not run", "both",
                 not kept))
    statuses = [s for shape in outcome.shapes for s in shape.statuses]
    counted = sum(v for k, v in outcome.metrics.items() if k.startswith("kvfork_http_requests_total")
                  and 'status="500"' in k)
    rows.append(("hostile wave: responses of status 500", f"{statuses.count(500)} (daemon counted {counted:g})", "0",
                 statuses.count(500) == 0 and counted == 0))
    unbounded = [f"{shape.name}: {s}" for shape in outcome.shapes for s in shape.statuses
                 if s is not None and s not in ALLOWED]
    rows.append(("hostile wave: hostile requests refused or bounded", f"{len(statuses) - len(unbounded)}/"
                 f"{len(statuses)}" + (f" ({', '.join(unbounded[:3])})" if unbounded else ""), "all",
                 not unbounded))
    read = sum(v for k, v in outcome.metrics.items() if k.startswith("kvfork_http_read_timeouts_total"))
    write = outcome.metrics.get("kvfork_http_write_timeouts_total", 0)
    ran = {s.name for s in outcome.shapes}
    rows.append(("hostile wave: slow connections closed and counted", f"read {read:g}, write {write:g}",
                 "> 0 each", (read > 0 or "slowloris" not in ran) and (write > 0 or "reader" not in ran)))
    return rows


def table(outcome: WaveOutcome) -> str:
    lines = ["| shape | innocent TTFT, median | x solo | hostile statuses |", "|---|---|---|---|",
             f"| (alone) | {outcome.solo_median * 1000:.0f} ms | 1.00 | |"]
    for s in outcome.shapes:
        counts: dict[str, int] = {}
        for status in s.statuses:
            said = {None: "closed", -1: "held open"}.get(status, str(status))  # type: ignore[arg-type]
            counts[said] = counts.get(said, 0) + 1
        said = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        ratio = s.median / statistics.median(s.solo)
        lines.append(f"| {s.name} | {s.median * 1000:.0f} ms | {ratio:.2f} | {said} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfork.tools.hostile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "mlx"))
    ap.add_argument("--samples", type=int, default=HostileConfig.innocent_samples,
                    help="innocent TTFTs per shape (and alone)")
    ap.add_argument("--shapes", help="comma-separated shapes to run (default: all)")
    ap.add_argument("--attack", choices=sorted(SHAPES), help=argparse.SUPPRESS)  # the hostile process
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.attack:
        statuses = asyncio.run(_attacking(args.attack, AttackTarget(**json.loads(args.target)), args.concurrency))
        print(json.dumps(statuses), flush=True)
        return 0
    from kvfork.backends.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    config = HostileConfig(model=model, backend=args.backend, innocent_samples=args.samples)
    outcome = asyncio.run(run_wave(config, shapes=args.shapes.split(",") if args.shapes else None))
    print(table(outcome))
    rows = checks(outcome)
    for name, measured, wanted, ok in rows:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {measured} (wanted {wanted})")
    return 0 if all(ok for *_, ok in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
