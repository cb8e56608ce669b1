"""`kvfork soak`: a daemon under load, faults and hostile input; prints one table of checks.

The daemon runs in this process (the fault-injecting backend of
tools/faulty_backend.py is handed to it here, never by a flag) and is driven over
HTTP on a loopback port, in waves. Each wave mixes:
- a shared-prefix burst (a fresh system prompt, which the rest of the burst
  follows the first for, or one from a small pool, which the prefix cache may hold);
- single chat and completion requests, streaming or not, short and long;
- late arrivals that find every slot busy;
- one turn of a named session (a few sessions, more than --max-named-sessions);
- bad bodies from a fuzzer (some compressed, some cut short or in a Content-Encoding the daemon does
  not decode), and valid requests with hostile sampling values.
About a quarter of the requests hang up, at a point drawn up front: a moment
after the engine has them (queued, parked behind a leader), once the backend has
committed a drawn share of the prompt (prefilling), or after some streamed
pieces (decoding). Where each really was when it hung up is read back from the
engine's request log line and reported (a faster machine lands fewer in the queue:
the per-phase behaviour is checked by the engine tests, which hold a request there).

Every choice is drawn from `--seed`; which backend call a fault hits depends on
timing. Requests are greedy; each carries a distinct `seed` (ignored by greedy
sampling) so a sampler, a submitted request and a response are matched exactly.

The soaked daemon decodes speculatively (`--speculative`, suffix unless told: drafts from the prompt
and from past responses, verified in the step), so the table says that it drafted.

Then the same requests that completed run one at a time on a second daemon with
active reuse, the prefix cache and speculative decoding off, and must return the same tokens: neither
reuse nor another request's speculation state may change a request's output. Both daemons store KV
state as `--kv-cache-dtype` says (auto unless told), so that holds at a quantized storage too.

Then the long-prompt wave (tools/long_prompts.py): a prompt of `--long-prompt-tokens` (24,000) is
cached, and three prompts leave it near its start, in its middle and near its end: each must reuse what
it shares and give a reuse-off daemon's tokens (`--long-prompt-tokens 0` skips it).

Last, the hostile-tenant wave (tools/hostile.py) on a third daemon with two
tenants: one sends the shapes a hostile client sends (oversized stops, nested
bodies, a template of its own, huge schemas, prompts at the character cap, slow
readers and slowloris connections, hoarding), the other must keep its time to
first token within max(2x solo, solo + 0.5 s), its stored response and named
session, and never see a 500 (`--no-hostile` skips it).
Exits 1 if a check fails, 2 if the soak cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import gzip
import json
import logging
import random
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from kvfork.backends import create_backend
from kvfork.backends.base import KV_CACHE_DTYPES
from kvfork.server.api.content_encoding import zstd
from kvfork.server.common.config import ServerConfig
from kvfork.server.engine.api import GenerateRequest
from kvfork.server.engine.config import SPECULATIVE_MODES, EngineConfig
from kvfork.server.launch.serve import Daemon, pick_backend
from kvfork.tools.bench.serve import parse_metrics
from kvfork.tools.bench.text import words
from kvfork.tools.faulty_backend import FaultyBackend, Fault
from kvfork.tools.memory import rss_bytes

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PHASES = ("queued", "parked", "prefilling", "decoding")
MiB = 1024 * 1024
SEED_BASE = 1_000_000  # request i carries seed SEED_BASE + i
RSS_GROWTH_LIMIT = 64 * MiB
MIN_COMPARED = 200
MIN_DISCONNECT_SHARE = 0.20
ANSWER_LIMIT_S = 180.0  # a request still unanswered then is a failure, not a hung soak


@dataclass
class SoakConfig:
    model: str
    backend: str = "auto"
    requests: int = 2000
    seed: int = 0
    fault_rate: float = 0.02  # per backend call of each kind
    kv_budget_bytes: int = 256 * MiB
    inference_slots: int = 4
    prefill_chunk: int = 32  # small, so prefills span steps and hang-ups can land in them
    max_named_sessions: int = 3
    named_sessions: int = 5
    reuse_min_tokens: int = 32
    prompt_words: int = 120  # the shared system prompts, about; long prompts are twice this
    max_tokens: int = 16
    queue_timeout: float = 60.0
    warmup_waves: int = 2
    hostile: bool = True  # the hostile-tenant wave, after the rest
    long_prompt_tokens: int = 24_000  # the long-prompt wave's cached prompt (tools/long_prompts.py); 0: none
    hostile_samples: int = 5  # the innocent tenant's TTFTs alone, and during each hostile shape
    speculative: str = "suffix"  # the soaked daemon's drafter (config.SPECULATIVE_MODES); the reference daemon's is off
    kv_cache_dtype: str = "auto"  # both daemons' KV storage (reuse on = off holds at each one)
    batch_invariant: bool = False  # both daemons' --batch-invariant


@dataclass
class Spec:
    index: int
    route: str
    body: dict
    disconnect: str | None = None  # the phase the hang-up aims at
    delay_s: float = 0.0  # queued / parked: hang up this long after the engine has it
    share: float = 0.0  # prefilling: hang up once this share of the prompt is committed
    after_tokens: int = 0  # decoding: hang up after this many streamed pieces
    stagger_s: float = 0.0  # sent this long after its wave starts
    session: str | None = None

    @property
    def seed(self) -> int | None:
        return self.body.get("seed")


@dataclass
class Outcome:
    spec: Spec
    sent_at: float = 0.0
    ended_at: float = 0.0
    status: int | None = None
    text: str = ""
    finish: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # code: message, from a status or a stream's error frame
    disconnected: bool = False

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.error is None and not self.disconnected and self.finish is not None

    def answer(self) -> tuple:
        return self.text, self.finish, self.completion_tokens


@dataclass
class Check:
    name: str
    measured: str
    wanted: str
    ok: bool


# ---- the workload ----


class SoakWorkload:
    """Seeded request specs, one wave at a time (named-session turns depend on earlier replies)."""

    def __init__(self, config: SoakConfig, vocab_size: int):
        self.config, self.vocab = config, vocab_size
        self.rng = random.Random(config.seed)
        self.count = 0
        self.prefixes = [f"Team {i}: " + words(random.Random(config.seed * 1000 + i), config.prompt_words)
                         for i in range(4)]
        self.chains: dict[str, list[dict]] = {f"soak-{i}": [] for i in range(config.named_sessions)}

    def _spec(self, route: str, body: dict, **kw: Any) -> Spec:
        self.count += 1
        body = {**body, "temperature": 0, "seed": SEED_BASE + self.count}
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
        return Spec(self.count, route, body, **kw)

    def _disconnect(self, p: float, phase: str) -> dict:
        rng = self.rng
        if rng.random() >= p:
            return {}
        if phase == "decoding":
            return dict(disconnect=phase, after_tokens=rng.randint(1, 6))
        if phase == "prefilling":
            return dict(disconnect=phase, share=rng.uniform(0.2, 0.8))
        return dict(disconnect=phase, delay_s=rng.uniform(0.0, 0.003))

    def _chat(self, messages: list[dict], stream: bool, max_tokens: int, **kw: Any) -> Spec:
        body = {"messages": messages, "max_tokens": max_tokens, "stream": stream}
        if self.rng.random() < 0.3:
            body["ignore_eos"] = True
        return self._spec(CHAT, body, **kw)

    def _completion(self, n_words: int, stream: bool, max_tokens: int, **kw: Any) -> Spec:
        rng = self.rng
        if rng.random() < 0.5:  # token ids: exact length, any token
            prompt: Any = [rng.randrange(3, self.vocab) for _ in range(n_words)]
        else:
            prompt = f"Note {self.count + 1}: " + words(rng, n_words)
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        return self._spec(COMPLETIONS, body, **kw)

    def wave(self) -> list[Spec]:
        rng, c = self.rng, self.config
        specs: list[Spec] = []
        # a known system prompt (the prefix cache may hold it) or a fresh one (the burst follows its leader)
        prefix = rng.choice(self.prefixes) if rng.random() < 0.4 else f"Crew {self.count}: " + words(rng, c.prompt_words)
        for member in range(rng.randint(3, 5)):  # the burst: the first leads, the rest may follow it
            messages = [{"role": "system", "content": prefix},
                        {"role": "user", "content": f"Task {self.count + 1}: " + words(rng, 8)}]
            hang_up = self._disconnect(0.4, "parked") if member else {}
            specs.append(self._chat(messages, rng.random() < 0.5, c.max_tokens,
                                    stagger_s=0.0 if not member else rng.uniform(0.0, 0.01), **hang_up))
        for _ in range(rng.randint(3, 5)):  # singles
            stream = rng.random() < 0.5
            phase = rng.choice(("prefilling", "decoding"))
            hang_up = self._disconnect(0.3, phase)
            if hang_up.get("disconnect") == "decoding":
                stream = True
            long = hang_up.get("disconnect") == "prefilling" or rng.random() < 0.2
            n_words = rng.randint(2 * c.prompt_words, 3 * c.prompt_words) if long else rng.randint(5, c.prompt_words)
            max_tokens = 4 * c.max_tokens if hang_up.get("disconnect") == "decoding" else rng.randint(1, c.max_tokens)
            stagger = rng.uniform(0.0, 0.05)
            if rng.random() < 0.5:
                specs.append(self._completion(n_words, stream, max_tokens, stagger_s=stagger, **hang_up))
            else:
                messages = [{"role": "user", "content": f"Question {self.count + 1}: " + words(rng, n_words)}]
                specs.append(self._chat(messages, stream, max_tokens, stagger_s=stagger, **hang_up))
        for _ in range(3):  # late: every slot is busy by now (on a fast machine, often not: aim many)
            specs.append(self._completion(rng.randint(5, c.prompt_words // 2), rng.random() < 0.5, c.max_tokens,
                                          stagger_s=0.06, **self._disconnect(0.6, "queued")))
        name = rng.choice(sorted(self.chains))  # one turn of a named session
        chain = self.chains[name]
        turn = chain + [{"role": "user", "content": f"Turn {self.count + 1}: " + words(rng, 10)}]
        if len(turn) > 9:  # keep sessions inside the context: start the conversation over
            turn = turn[-1:]
        spec = self._chat(turn, rng.random() < 0.5, c.max_tokens, stagger_s=rng.uniform(0.0, 0.05), session=name,
                          **self._disconnect(0.15, "decoding"))
        spec.body["session_id"] = name
        specs.append(spec)
        return specs

    def answered(self, outcome: Outcome) -> None:
        """A named session's turn that completed becomes its history."""
        spec = outcome.spec
        if spec.session is not None and outcome.completed:
            self.chains[spec.session] = spec.body["messages"] + [{"role": "assistant", "content": outcome.text}]


# Values that break sampling or seeding somewhere, and the fields a fuzzer mixes them into.
HOSTILE_SAMPLING = [{"temperature": 1e-40}, {"temperature": 1e-7}, {"seed": -1}, {"seed": 2**64 - 1},
                    {"seed": -(2**63)}, {"temperature": 1.0, "seed": -5}, {"temperature": 0.7, "seed": 2**63 + 7}]
_FUZZ_VALUES = [None, True, -1, 0, 1.5, 10**30, "", "x", [], [1, "a"], {}, {"a": 1}, "\ud800", [[]], [[1, -2]]]
_FUZZ_FIELDS = ["messages", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                "logit_bias", "n", "stream", "stream_options", "tools", "tool_choice", "logprobs", "top_logprobs",
                "prompt", "session_id", "chat_template_kwargs", "response_format", "echo", "stop_token_ids",
                "repetition_penalty", "presence_penalty"]


FUZZ_BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
# Bodies that are no JSON object at all, or not the one a route wants.
MALFORMED = [b"null", b"[]", b'"x"', b"1e999", b"\xff\xfe\x00", b"{" * 5000, b'{"messages": 1}']


def fuzz_coding(rng: random.Random, data: bytes) -> tuple[bytes, str | None]:
    """A fuzzed body as it is sent: as is, in a Content-Encoding the daemon decodes (a fifth of those cut
    short, so they do not decode), or labelled with one it does not decode (br)."""
    coding = rng.choice((None, None, "gzip", "deflate", "zstd", "br"))
    if coding in (None, "br"):
        return data, coding
    packed = {"gzip": gzip.compress, "deflate": zlib.compress, "zstd": zstd().compress}[coding](data)
    return (packed[:rng.randrange(len(packed))] if rng.random() < 0.2 else packed), coding


def fuzz_bodies(rng: random.Random, n: int, good: dict) -> list[bytes]:
    """`n` bodies built from `good` with 1-3 fields set to hostile values."""
    bodies = []
    for _ in range(n):
        body = dict(good)
        for name in rng.sample(_FUZZ_FIELDS, rng.randint(1, 3)):
            body[name] = rng.choice(_FUZZ_VALUES)
        if rng.random() < 0.3:
            body["messages"] = [{"role": rng.choice(["user", "tool", "x"]), "content": rng.choice(_FUZZ_VALUES)}]
        bodies.append(json.dumps(body).encode())
    return bodies


# ---- the client side ----


async def exchange(http: aiohttp.ClientSession, url: str, spec: Spec, out: Outcome) -> None:
    async with http.post(url + spec.route, json=spec.body) as r:
        out.status = r.status
        if r.status != 200:
            out.error = _error_text(await r.json(content_type=None))
            return
        if not spec.body.get("stream"):
            body = await r.json()
            choice = body["choices"][0]
            out.text = choice["message"]["content"] or "" if spec.route == CHAT else choice["text"]
            out.finish, out.completion_tokens = choice["finish_reason"], body["usage"]["completion_tokens"]
            return
        pieces = 0
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[len("data: "):])
            if "error" in frame:
                out.error = _error_text(frame)
                return
            if frame.get("usage"):
                out.completion_tokens = frame["usage"]["completion_tokens"]
            for choice in frame.get("choices", ()):
                text = choice["delta"].get("content") if spec.route == CHAT else choice.get("text")
                if text:
                    out.text += text
                    pieces += 1
                out.finish = choice.get("finish_reason") or out.finish
            if spec.disconnect == "decoding" and pieces >= spec.after_tokens and out.finish is None:
                out.disconnected = True
                r.close()
                return


def _error_text(body: Any) -> str:
    error = body.get("error", {}) if isinstance(body, dict) else {}
    return f"{error.get('code')}: {error.get('message')}"


async def send(http: aiohttp.ClientSession, url: str, spec: Spec, moment: "Moments") -> Outcome:
    await asyncio.sleep(spec.stagger_s)
    out = Outcome(spec, sent_at=time.monotonic())
    talk = asyncio.ensure_future(asyncio.wait_for(exchange(http, url, spec, out), ANSWER_LIMIT_S))
    if spec.disconnect in ("queued", "parked", "prefilling"):
        hang_up = asyncio.ensure_future(moment.reached(spec))
        await asyncio.wait([talk, hang_up], return_when=asyncio.FIRST_COMPLETED)
        hang_up.cancel()
        if not talk.done():
            talk.cancel()
            out.disconnected = True
    try:
        await talk
    except asyncio.CancelledError:
        if not out.disconnected:
            raise
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError) as e:  # the daemon broke the protocol
        out.error = f"client: {type(e).__name__}: {e}"
    except TimeoutError:
        out.error = f"client: no answer within {ANSWER_LIMIT_S:g} s"
    out.ended_at = time.monotonic()
    return out


class Moments:
    """When a client hangs up: a moment after the engine has its request (queued, parked), or once the
    backend has committed a drawn share of its prompt (prefilling). Both are signalled, never polled:
    polling from the loop would fight the runner thread for the GIL."""

    LIMIT_S = 10.0

    def __init__(self, recorder: "Recorder", backend: FaultyBackend):
        self.recorder, self.backend = recorder, backend

    async def reached(self, spec: Spec) -> None:
        try:
            async with asyncio.timeout(self.LIMIT_S):
                req = await self.recorder.submitted(spec.seed)
                if spec.disconnect == "prefilling":
                    await self.backend.when_holds(req.prompt[:max(1, int(len(req.prompt) * spec.share))])
                    return
        except TimeoutError:
            return
        await asyncio.sleep(spec.delay_s)


class Recorder:
    """Records what the routes submit to the engine, by seed: it stands in for the engine's `submit`."""

    def __init__(self, submit: Callable[[GenerateRequest], Any]):
        self._submit = submit
        self.by_seed: dict[int, GenerateRequest] = {}
        self._waiting: dict[int, asyncio.Future] = {}

    def submit(self, req: GenerateRequest) -> Any:
        seed = req.sampling.seed
        if seed is not None:
            self.by_seed[seed] = req
            waiting = self._waiting.pop(seed, None)
            if waiting is not None and not waiting.done():
                waiting.set_result(req)
        return self._submit(req)

    async def submitted(self, seed: int) -> GenerateRequest:
        if seed in self.by_seed:
            return self.by_seed[seed]
        return await self._waiting.setdefault(seed, asyncio.get_running_loop().create_future())


class RequestLog(logging.Handler):
    """The engine's one line per request, by request id."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: dict[str, dict] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("request {"):
            fields = json.loads(message[len("request "):])
            self.lines[fields["request_id"]] = fields


def phase_of(line: dict) -> str:
    """Where a request was when it ended, from its log line."""
    if line["generated_tokens"] > 0:
        return "decoding"
    if line["prefilled_tokens"] > 0:
        return "prefilling"
    if line.get("follow"):
        return "parked"
    if line["prefill_s"] == 0:  # never admitted: no time between admission and the end
        return "queued"
    return "starting"


async def read_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


# ---- the run ----


def engine_config(c: SoakConfig, reuse: bool) -> EngineConfig:
    return EngineConfig(
        inference_slots=c.inference_slots, prefill_chunk=c.prefill_chunk, kv_budget_bytes=c.kv_budget_bytes,
        max_queue=256, queue_timeout=c.queue_timeout, max_tokens=c.max_tokens,
        max_named_sessions=c.max_named_sessions, prefix_cache_min_tokens=16,
        prefix_cache_entries=16 if reuse else 0, active_prefix_reuse_min_tokens=c.reuse_min_tokens if reuse else 0,
        follow_max_wait=5.0, speculative=c.speculative if reuse else "off", kv_cache_dtype=c.kv_cache_dtype,
        batch_invariant=c.batch_invariant,
        # Off: the fault wrapper charges a fault to the tokens a session holds, which a session loaded
        # from the disk tier does not tell it (tests/engine/test_disk_tier.py covers the tier's own faults).
        prefix_cache_disk_bytes=0,
    )


def daemon(c: SoakConfig, backend: Any, reuse: bool) -> contextlib.AbstractAsyncContextManager[Daemon]:
    config = ServerConfig(model=c.model, port=0, host="127.0.0.1", shutdown_grace=1.0, dtype="float32",
                          max_body_bytes=256 * 1024)
    return Daemon(config, engine_config(c, reuse), c.model, backend).serving()


@dataclass
class SoakReport:
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, measured: Any, wanted: str, ok: bool) -> None:
        self.checks.append(Check(name, str(measured), wanted, ok))

    def table(self) -> str:
        rows = [("check", "measured", "wanted", "")] + [(c.name, c.measured, c.wanted, "ok" if c.ok else "FAIL")
                                                        for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [" | ".join(r[i].ljust(widths[i]) for i in range(3)) + " | " + r[3] for r in rows]
        lines.insert(1, "-+-".join("-" * w for w in widths) + "-+-")
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def hit_by(outcome: Outcome, prompt: list[int] | None, faults: list[Fault]) -> list[Fault]:
    """The faults that could have touched this request: during its life, on its sampler or on a session
    whose tokens agree with its prompt."""
    seed = outcome.spec.seed
    out = []
    for f in faults:
        if not outcome.sent_at <= f.at <= outcome.ended_at:
            continue
        if (seed is not None and seed in f.seeds) or (prompt is not None and any(
                t and list(t[:len(prompt)]) == prompt[:len(t)] for t in f.tokens)):
            out.append(f)
    return out


async def run(c: SoakConfig, out=sys.stdout) -> SoakReport:
    backend_name, inner = pick_backend(c.backend)
    faulty = FaultyBackend(inner, c.seed, c.fault_rate, c.kv_budget_bytes)
    report = SoakReport()
    request_log = RequestLog()
    kvfork_log = logging.getLogger("kvfork")
    saved = kvfork_log.level, kvfork_log.propagate
    kvfork_log.setLevel(logging.INFO)
    kvfork_log.propagate = False  # injected faults log a warning each: the table says what matters
    kvfork_log.addHandler(request_log)
    try:
        outcomes, fuzzed, hostile = await _soak(c, faulty, report, request_log, backend_name, out)
    finally:
        kvfork_log.removeHandler(request_log)
        kvfork_log.setLevel(saved[0])
        kvfork_log.propagate = saved[1]
    await _compare(c, backend_name, outcomes, report, out)
    if c.long_prompt_tokens:
        from kvfork.tools.long_prompts import run_long_wave

        for row in await run_long_wave(c.model, backend_name, c.long_prompt_tokens, c.seed, out):
            report.add(*row)
    if c.hostile:
        await _hostile_wave(c, report, out)
    print(report.table(), file=out)
    return report


async def _hostile_wave(c: SoakConfig, report: SoakReport, out) -> None:
    from kvfork.tools.hostile import HostileConfig, checks, run_wave, table

    print("soak: the hostile-tenant wave", file=out, flush=True)
    outcome = await run_wave(HostileConfig(model=c.model, backend=c.backend, innocent_samples=c.hostile_samples),
                             out=out)
    for name, measured, wanted, ok in checks(outcome):
        report.add(name, measured, wanted, ok)
    print(table(outcome), file=out, flush=True)


async def _soak(c: SoakConfig, faulty: FaultyBackend, report: SoakReport, request_log: RequestLog, backend_name: str,
                out) -> tuple[list[Outcome], list[Fuzzed], list[Outcome]]:
    rng = random.Random(c.seed + 1)
    async with daemon(c, faulty, reuse=True) as d, aiohttp.ClientSession() as http:
        recorder = Recorder(d.engine.submit)
        d.engine.submit = recorder.submit  # type: ignore[method-assign]
        info = d.engine.info
        assert info is not None
        workload = SoakWorkload(c, info.vocab_size)
        faulty.enabled = True
        moments = Moments(recorder, faulty)
        outcomes: list[Outcome] = []
        fuzzed: list[Fuzzed] = []
        hostile: list[Outcome] = []
        rss_warm, kv_warm, wave = 0, 0, 0
        t0 = time.monotonic()
        while workload.count < c.requests:
            specs = workload.wave()
            extra = [_hostile(workload, rng)] if wave % 2 == 0 else []
            bodies = (MALFORMED if wave == 0 else []) + fuzz_bodies(rng, 2, FUZZ_BASE)
            tasks = [send(http, d.url, s, moments) for s in specs + extra]
            fuzz = [_post_raw(http, d.url + rng.choice((CHAT, COMPLETIONS)), *fuzz_coding(rng, b)) for b in bodies]
            results = await asyncio.gather(*tasks, asyncio.gather(*fuzz))
            done, fuzz_statuses = list(results[:-1]), results[-1]
            fuzzed += fuzz_statuses
            outcomes += done[:len(specs)]
            hostile += done[len(specs):]
            for o in done[:len(specs)]:
                workload.answered(o)
            wave += 1
            if wave == c.warmup_waves:
                gc.collect()
                rss_warm, kv_warm = rss_bytes(), faulty.watch.held_bytes
            if wave % 10 == 0:
                print(f"soak: {workload.count}/{c.requests} requests, {len(faulty.watch.faults)} faults, "
                      f"{time.monotonic() - t0:.0f} s", file=out, flush=True)
        faulty.enabled = False
        metrics = await _quiesce(http, d.url)
        gc.collect()
        rss_end = rss_bytes()
        _checks(c, report, d, recorder, request_log, faulty, outcomes, fuzzed, hostile, metrics, backend_name,
                rss_warm, rss_end - (faulty.watch.held_bytes - kv_warm), time.monotonic() - t0)
    return outcomes, fuzzed, hostile


def _hostile(workload: SoakWorkload, rng: random.Random) -> Spec:
    """A valid completion with a sampling value that breaks a naive sampler; its prompt ids are its own."""
    workload.count += 1
    body = {"prompt": [rng.randrange(3, workload.vocab) for _ in range(rng.randint(4, 24))], "max_tokens": 2,
            **rng.choice(HOSTILE_SAMPLING)}
    return Spec(-workload.count, COMPLETIONS, body)


@dataclass
class Fuzzed:
    body: bytes  # as sent, in `coding`
    coding: str | None
    status: int
    shaped: bool  # an error in OpenAI's shape (or no error)
    error: str = ""


async def _post_raw(http: aiohttp.ClientSession, url: str, data: bytes, coding: str | None) -> Fuzzed:
    headers = {"Content-Type": "application/json", **({"Content-Encoding": coding} if coding else {})}
    async with http.post(url, data=data, headers=headers) as r:
        if r.status < 400:
            return Fuzzed(data, coding, r.status, True)
        body = await r.json(content_type=None)
        shaped = isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict) \
            and set(body["error"]) == {"message", "type", "param", "code"}
        return Fuzzed(data, coding, r.status, shaped, _error_text(body))


_FAULT_ID = re.compile(r"injected \w+ fault #(\d+)")


def names_hard_fault(error: str, faults: list[Fault]) -> bool:
    """A fuzzed body carries no seed of its own: its 503 is excused only when it names a hard fault."""
    return any(faults[int(i) - 1].hard for i in _FAULT_ID.findall(error) if 0 < int(i) <= len(faults))


async def _quiesce(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """Wait (bounded) until nothing runs, waits or follows, and the last releases have been reported."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        m = await read_metrics(http, url)
        if all(m.get(f"kvfork_{g}", 0) == 0 for g in ("queue_depth", "following_requests", "running_requests")):
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # the runner reports what it holds after the last releases
    return await read_metrics(http, url)


def _checks(c: SoakConfig, report: SoakReport, d: Daemon, recorder: Recorder, request_log: RequestLog,
            faulty: FaultyBackend, outcomes: list[Outcome], fuzzed: list[Fuzzed], hostile: list[Outcome],
            m: dict[str, float], backend_name: str, rss_warm: int, rss_end: int, seconds: float) -> None:
    faults = faulty.watch.faults
    prompts = {o.spec.index: _prompt(recorder, o) for o in outcomes + hostile}
    by_kind: dict[str, int] = {}
    for f in faults:
        by_kind[f"{f.kind}/{f.mode}"] = by_kind.get(f"{f.kind}/{f.mode}", 0) + 1
    report.notes.append(f"{c.requests} requests on {backend_name} in {seconds:.0f} s; faults injected: "
                        + (", ".join(f"{k} {v}" for k, v in sorted(by_kind.items())) or "none"))

    # 500s: from the clients' side, and as the daemon counted them
    statuses = [o.status for o in outcomes + hostile if o.status is not None] + [f.status for f in fuzzed]
    server_500 = sum(v for k, v in m.items() if k.startswith("kvfork_http_requests_total") and 'status="500"' in k)
    report.add("responses of status 500", f"{statuses.count(500)} (daemon counted {server_500:g})", "0",
               statuses.count(500) == 0 and server_500 == 0)
    bad = [f for f in fuzzed if not f.shaped or (f.status >= 500 and not (
        f.status == 503 and names_hard_fault(f.error, faults)))]
    report.add("fuzzed bodies: no 5xx, errors in OpenAI's shape", f"{len(fuzzed) - len(bad)}/{len(fuzzed)}", "all",
               not bad)
    for f in bad[:3]:
        report.notes.append(f"fuzzed body {f.body[:120]!r} ({f.coding or 'plain'}): {f.status} {f.error}")

    # faults stay where they start
    unexplained = []
    for o in outcomes + hostile:
        if o.disconnected or o.error is None or o.status == 429:
            continue
        if not any(f.hard for f in hit_by(o, prompts[o.spec.index], faults)):
            unexplained.append(o)
    errored = sum(1 for o in outcomes + hostile if o.error is not None and not o.disconnected)
    report.add("errors on requests no hard fault hit", f"{len(unexplained)} of {errored} errors", "0",
               not unexplained)
    for o in unexplained[:5]:
        report.notes.append(f"unexplained error on request {o.spec.index} ({o.spec.route}, "
                            f"body {json.dumps({k: v for k, v in o.spec.body.items() if k in ('seed', 'temperature', 'session_id', 'stream')})}): {o.error}")
    hostile_bad = [o for o in hostile if o.status not in (200, 400) and o not in unexplained
                   and not any(f.hard for f in hit_by(o, prompts[o.spec.index], faults))]
    report.add("hostile sampling values: 200 or 400", f"{len(hostile) - len(hostile_bad)}/{len(hostile)}", "all",
               not hostile_bad)
    reads = faulty.watch.corrupt_reads
    report.add("reads of sessions reported corrupt", f"{len(reads)} (of {len({sid for sid, _ in reads})} sessions)", "0", not reads)
    for _, line in reads[:3]:
        report.notes.append(line)

    # disconnects, by where they landed
    phases = {p: 0 for p in PHASES}
    landed_elsewhere = 0
    for o in outcomes:
        if not o.disconnected:
            continue
        req = recorder.by_seed.get(o.spec.seed)
        line = request_log.lines.get(req.request_id) if req is not None else None
        phase = phase_of(line) if line is not None else "before the engine"
        if phase in phases:
            phases[phase] += 1
        else:
            landed_elsewhere += 1
    gone = sum(1 for o in outcomes if o.disconnected)
    report.add("client disconnects", f"{gone}/{len(outcomes)} ({gone / max(1, len(outcomes)):.0%})",
               f">= {MIN_DISCONNECT_SHARE:.0%}", gone >= MIN_DISCONNECT_SHARE * len(outcomes))
    # Where a hang-up lands moves with the machine's speed (a faster one admits a request before its
    # "queued" moment), so it is reported, not checked: tests/engine/test_cancel.py and test_engine_follow.py
    # hold a request in each phase (a gated runner) and check that hanging up there frees its place.
    report.notes.append("disconnects by phase: " + ", ".join(f"{p} {n}" for p, n in phases.items())
                        + f" (+{landed_elsewhere} elsewhere)")

    # what is held once the clients are gone (gauges where /metrics has them; else the engine, in-process)
    stats = d.engine.stats()
    live, cache, named = m.get("kvfork_live_sessions", -1), stats.cached, stats.named_holding
    report.add("live sessions = cache entries + named sessions", f"{live:g} = {cache} + {named}",
               "equal", live == cache + named)
    reserved = m.get("kvfork_kv_reserved_bytes", -1)
    report.add("reserved bytes", f"{reserved:g}", "0", reserved == 0)
    # The backend's published KVCost says how far its own count may stray: exact on torch; on MLX a
    # fraction of the figure plus one step of slots per session it holds.
    held, view, kv = m.get("kvfork_kv_bytes", -1), stats.held, d.engine.info.kv
    slack = kv.tolerance * view + (live * kv.step * kv.full_bytes_per_token if kv.tolerance else 0)
    report.add("backend bytes = budget's view (stats().held)", f"{held:g} vs {view}",
               "equal" if not kv.tolerance else f"within {kv.tolerance:.0%} + a step per session",
               abs(held - view) <= slack)
    report.add("calls after which the backend held > --kv-budget-bytes", f"{faulty.watch.over_budget} "
               f"(peak {faulty.watch.peak_bytes / MiB:.2f} MiB of {c.kv_budget_bytes / MiB:.2f})", "0",
               faulty.watch.over_budget == 0)
    growth = rss_end - rss_warm
    report.add("RSS growth after warm-up, beyond the KV the backend holds more", f"{growth / MiB:+.1f} MiB",
               f"<= +{RSS_GROWTH_LIMIT // MiB} MiB", growth <= RSS_GROWTH_LIMIT)
    if c.speculative != "off":
        drafted = sum(v for k, v in m.items() if k.startswith("kvfork_spec_drafted_tokens_total"))
        report.add(f"tokens drafted (--speculative {c.speculative})", f"{drafted:g}", "> 0", drafted > 0)
    report.add("runner alive at the end", "yes" if d.engine.ready else "no", "yes", bool(d.engine.ready))


def _prompt(recorder: Recorder, o: Outcome) -> list[int] | None:
    body = o.spec.body
    if isinstance(body.get("prompt"), list):
        return body["prompt"]
    req = recorder.by_seed.get(o.spec.seed) if isinstance(body.get("seed"), int) else None
    return list(req.prompt) if req is not None else None


async def _compare(c: SoakConfig, backend_name: str, outcomes: list[Outcome], report: SoakReport, out) -> None:
    """Every completed request, again, one at a time, on a daemon with reuse and the cache off."""
    completed = [o for o in outcomes if o.completed]
    print(f"soak: replaying {len(completed)} completed requests on a reuse-off daemon", file=out, flush=True)
    differ: list[tuple[Outcome, tuple]] = []
    t0 = time.monotonic()
    async with daemon(c, create_backend(backend_name), reuse=False) as d, aiohttp.ClientSession() as http:
        for n, o in enumerate(completed, 1):
            spec = o.spec
            body = {k: v for k, v in spec.body.items() if k not in ("session_id", "stream", "stream_options")}
            again = Outcome(Spec(spec.index, spec.route, body))
            await exchange(http, d.url, again.spec, again)
            if again.answer() != o.answer() or again.error:
                differ.append((o, again.answer() if not again.error else (again.error,)))
            if n % 100 == 0:
                print(f"soak: replayed {n}/{len(completed)}, {len(differ)} differ, {time.monotonic() - t0:.0f} s",
                      file=out, flush=True)
    report.add("completed requests equal to a reuse-off daemon", f"{len(completed) - len(differ)}/{len(completed)}",
               f"all, and >= {MIN_COMPARED}", not differ and len(completed) >= MIN_COMPARED)
    for o, ref in differ[:5]:
        report.notes.append(f"request {o.spec.index} ({o.spec.route}, stream={o.spec.body.get('stream')}, "
                            f"session={o.spec.session}): {o.answer()!r} vs reuse off {ref!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfork soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the default model, fetched if needed)")
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "mlx"))
    defaults = SoakConfig(model="")
    ap.add_argument("--requests", type=int, default=defaults.requests, help="requests to send, bad bodies aside")
    ap.add_argument("--seed", type=int, default=defaults.seed, help="draws the workload, hang-ups and faults")
    ap.add_argument("--fault-rate", type=float, default=defaults.fault_rate,
                    help="chance that one backend call of each kind fails")
    ap.add_argument("--kv-budget-bytes", type=int, default=defaults.kv_budget_bytes,
                    help="the daemon's KV budget: small enough that admission waits and the cache gives way")
    ap.add_argument("--long-prompt-tokens", type=int, default=defaults.long_prompt_tokens,
                    help="the long-prompt wave's cached prompt, in tokens (0: no wave)")
    ap.add_argument("--hostile", action=argparse.BooleanOptionalAction, default=defaults.hostile,
                    help="end with the hostile-tenant wave (tools/hostile.py)")
    ap.add_argument("--speculative", default=defaults.speculative, choices=SPECULATIVE_MODES,
                    help="the soaked daemon's speculative decoding; the reference daemon's is off")
    ap.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                    help="both daemons' KV storage (torch: int8 and int4 need heads the group size divides)")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="both daemons compute batch-invariantly (torch: reuse exact under a quantized storage)")
    args = ap.parse_args(argv)
    from kvfork.backends import prepare_process

    prepare_process(args.backend)
    if args.model:
        model = args.model
    else:
        from kvfork.backends.default_model import FetchError, ensure_default_model

        try:
            model = str(ensure_default_model())
        except FetchError as e:
            print(f"soak: the default model is not available: {e} (or pass --model FOLDER)", file=sys.stderr)
            return 2
    config = SoakConfig(model=model, backend=args.backend, requests=args.requests, seed=args.seed,
                        fault_rate=args.fault_rate, kv_budget_bytes=args.kv_budget_bytes,
                        long_prompt_tokens=args.long_prompt_tokens, hostile=args.hostile,
                        speculative=args.speculative, kv_cache_dtype=args.kv_cache_dtype,
                        batch_invariant=args.batch_invariant)
    try:
        report = asyncio.run(run(config))
    except (OSError, RuntimeError) as e:
        print(f"soak: could not run: {e}", file=sys.stderr)
        return 2
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
