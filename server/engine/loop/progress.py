"""The running phases, Prefilling, Decoding and Paused: the runner's events about a request it runs (its start, its
tokens, its capture, the positions it committed) and about the whole batch (the bytes it holds, a spill's state).

A part of `Serving` (serving.py), built with what it reads and writes: the request table (read), the managers it
tells (Admission, Index, the ledger, the disk tier), the metrics, the shared rates, and `admit` to call once bytes
come back. Its surface: the `on_*` handlers and `observe_clone` (a donor's clone landed, which parking.py reports too).
"""

from __future__ import annotations

import time
from typing import Callable

from kvfork.backends.vision.keys import image_tokens
from kvfork.server.engine import messages as m
from kvfork.server.engine.api import TokenEvent
from kvfork.server.engine.cache.disk import DiskTier
from kvfork.server.engine.cache.index import Index
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop import request as phase
from kvfork.server.engine.loop.admission import Admission
from kvfork.server.engine.loop.ledger import LoopLedger
from kvfork.server.engine.loop.request import Prefilling, Request, WithRunner
from kvfork.server.engine.loop.telemetry import EngineMetrics
from kvfork.server.engine.policy.rates import LiveRates


class Progress:
    def __init__(self, requests: dict[int, Request], admission: Admission, index: Index, ledger: LoopLedger,
                 disk: DiskTier | None, config: EngineConfig, metrics: EngineMetrics, rates: LiveRates,
                 admit: Callable[[], None]):
        """`requests`: the state machine's table of requests, by id (read, never changed here)."""
        self._requests, self._admission, self._index = requests, admission, index
        self._ledger, self._disk = ledger, disk
        self._config, self._metrics, self._rates, self._admit = config, metrics, rates, admit

    def on_started(self, ev: m.Started) -> None:
        r = self._requests.get(ev.rid)
        if r is None:
            return
        p = r.phase
        assert isinstance(p, Prefilling)
        donor_upto, candidates = p.donor_upto, p.candidates
        phase.started(r, ev.reused)
        r.reused = ev.reused
        r.images_encoded = ev.encoded
        if ev.encoded:
            self._metrics.images_encoded.inc(ev.encoded)
        self._index.moved(r.rid, ev.reused, ())
        if donor_upto:
            self.observe_clone("donor", [], ev.reused, ev.clone_s, r, p.cached)
        # Where its session starts is known now: its reservation shrinks to what that session grows to
        # (a named session is always opened empty; a clone at `reused`).
        adm = self._admission
        start = 0 if r.named is not None else ev.reused
        adm.reserve(r, adm.request_bytes(len(r.prompt), r.max_tokens, start, len(adm.checkpoints(r.req)),
                                         image_tokens(r.prompt[start:])))
        if r.parent is not None:  # a choice's clone of its parent: the prompt is counted once, on choice 0
            r.reused = 0
            return
        r.handle.reused = r.reused  # final from here: APIs that say the usage split up front read it
        if r.named is not None:
            r.reuse_source = "session" if ev.reused else None
        elif ev.clone_index is not None:
            r.reuse_source = "cache"
            self._rates.tracker = self._rates.tracker.observe_clone(ev.reused, ev.clone_s)
            self._index.touch(candidates[ev.clone_index].entry)
        elif not ev.reused:
            r.reuse_source = None
        if r.named is None and r.reuse_source != "donor":
            self._metrics.cache_admissions.inc(outcome="hit" if ev.clone_index is not None else "miss")
        if candidates:
            self._metrics.clone("cache", ev.refused, ev.clone_index is not None)

    def observe_clone(self, source: str, refused: list[str], upto: int, seconds: float, r: Request,
                       cached: int) -> None:
        """A donor's clone landed for `r` (`cached`: the best prefix cache match it had instead)."""
        self._metrics.clone(source, refused, True)
        self._rates.tracker = self._rates.tracker.observe_clone(upto, seconds)
        r.reuse_source = "donor"
        self._metrics.donor_saved.inc(max(0, upto - cached))

    def on_token(self, ev: m.Token) -> None:
        r = self._requests.get(ev.rid)
        if r is None or r.ending:
            return  # asked to end: what the runner made meanwhile is dropped
        if isinstance(r.phase, Prefilling):
            phase.decode(r)
        now = time.monotonic()
        self._metrics.token(r, now)
        r.first_token_at = r.first_token_at or now
        r.last_token_at = now
        r.handle.put(TokenEvent(ev.sampled.token, ev.sampled.logprob, ev.sampled.top_logprobs))

    def on_captured(self, ev: m.Captured) -> None:
        adm = self._admission
        r = self._requests.get(ev.rid)
        if r is not None:
            adm.capture_done(r)
        if ev.sid is None:
            self._metrics.captures.inc(outcome="failed" if ev.failed else "refused")
        elif r is None or r.ending == "cancelled":  # a capture of a cancelled request is discarded
            self._metrics.captures.inc(outcome="discarded")
            adm.release_sessions([ev.sid])
        else:
            self._metrics.captures.inc(outcome="stored")
            adm.keep_snapshot(r, ev.tokens, ev.sid, ev.nbytes, r.req.scope, ev.kept)

    def on_exported(self, ev: m.Exported) -> None:
        """A spilled entry's state is on the host: to its file; its bytes go back once written."""
        tokens, scope, nbytes = ev.key

        def written(_: bool) -> None:
            self._ledger.spilled(nbytes)
            self._admit()

        if ev.state is None or self._disk is None:
            written(False)
        else:
            self._disk.write(ev.state, tokens, scope, written)

    def on_ledger(self, ev: m.Ledger) -> None:
        """What the backend holds (after a step, commands, or an end): the loop's byte view follows it."""
        self._ledger.update(ev)
        self._metrics.holding(ev.total_bytes, self._config.kv_budget_bytes)

    def on_step_stats(self, ev: m.StepStats) -> None:
        self._metrics.step(ev)
        self._rates.tracker = self._rates.tracker.observe_prefill(ev.prefill_tokens, ev.prefill_s)
        for rid, position in ev.committed.items():
            r = self._requests.get(rid)
            if r is not None and isinstance(r.phase, WithRunner):
                r.phase.committed, r.phase.checkpoints = position, ev.kept.get(rid, ())
                self._index.moved(rid, position, r.phase.checkpoints)

