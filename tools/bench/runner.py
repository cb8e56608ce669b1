"""Replays a workload against one server and records every call.

Each call is one task that waits for its trigger (another call's event plus a
delay), then streams. A call that fails still sets all its events, so nothing
waits forever on it. Root sessions take a place among `root_concurrency`
before their first call and give it back after their last.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from kvfork.tools.bench.client import Record, Target, request_body, stream_chat
from kvfork.tools.bench.stats import percentile
from kvfork.tools.bench.workload import Call, Workload


@dataclass
class Events:
    start: asyncio.Event = field(default_factory=asyncio.Event)
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def finish(self) -> None:
        for ev in (self.start, self.first_token, self.done):
            ev.set()


class ReplayProgress:
    """One status line: rewritten in place on a terminal, every 10% otherwise."""

    def __init__(self, label: str, total: int, out=sys.stderr):
        self.label, self.total, self.out = label, total, out
        self.done = self.failed = self.in_flight = 0
        self.ttfts: list[float] = []
        self.t0 = time.monotonic()
        self.tty = out.isatty()
        self._step = max(1, total // 10)

    def started(self) -> None:
        self.in_flight += 1

    def finished(self, rec: Record) -> None:
        self.in_flight -= 1
        self.done += 1
        self.failed += not rec.ok
        if rec.ok and rec.ttft_s is not None:
            self.ttfts.append(rec.ttft_s)
        if self.tty or self.done % self._step == 0 or self.done == self.total:
            self.show()

    def show(self) -> None:
        line = f"[{self.label}] {self.done}/{self.total} done, {self.in_flight} in flight, {self.failed} failed"
        if self.ttfts:
            line += f", TTFT p50 {percentile(self.ttfts, 50):.2f}s"
        line += f", {time.monotonic() - self.t0:.1f}s"
        end = "\n" if not self.tty or self.done == self.total else ""
        self.out.write(("\r\x1b[K" if self.tty else "") + line + end)
        self.out.flush()


@dataclass
class RunResult:
    workload: str
    records: list[Record]
    wall_s: float


async def replay(workload: Workload, target: Target, label: str = "run", logprobs: bool = False,
                 ignore_eos: bool = True, progress_out=sys.stderr) -> RunResult:
    events = {c.id: Events() for c in workload.calls}
    first_of = {}
    last_of = {}
    for c in workload.calls:
        first_of.setdefault(c.session, c.id)
        last_of[c.session] = c.id
    gate = asyncio.Semaphore(workload.root_concurrency) if workload.root_concurrency else None
    gated = set(workload.roots) if gate else set()
    placed: set[str] = set()  # root sessions holding a place now
    progress = ReplayProgress(label, len(workload.calls), progress_out)
    records = {c.id: Record(c.id, c.session, c.tag) for c in workload.calls}
    t0 = time.monotonic()

    async def run_call(index: int, call: Call, http: aiohttp.ClientSession) -> None:
        ev = events[call.id]
        try:
            if call.on == "idle":
                await asyncio.gather(*(events[c.id].done.wait() for c in workload.calls[:index]))
            elif call.after is not None:
                await getattr(events[call.after], call.on).wait()
            if call.delay_s:
                await asyncio.sleep(call.delay_s)
            if (wait := call.not_before_s - (time.monotonic() - t0)) > 0:
                await asyncio.sleep(wait)
            if call.session in gated and first_of[call.session] == call.id:
                await gate.acquire()
                placed.add(call.session)
            ev.start.set()
            progress.started()
            body = request_body(call.messages, call.max_tokens, target.model, logprobs, ignore_eos)
            await stream_chat(http, target, records[call.id], body, t0, ev.first_token.set)
            progress.finished(records[call.id])
        finally:
            ev.finish()
            if call.session in placed and last_of[call.session] == call.id:
                placed.discard(call.session)
                gate.release()

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        await asyncio.gather(*(run_call(i, c, http) for i, c in enumerate(workload.calls)))
    return RunResult(workload.name, [records[c.id] for c in workload.calls], time.monotonic() - t0)
