"""The engine's metrics and its one structured log line per request.

Only the control loop writes here. Reuse of every kind is one counter family
labelled by source (cache, donor, session), so `/metrics` adds them up or splits
them the same way the usage does. The log line never carries prompt text.
"""

from __future__ import annotations

import json
import logging
from typing import Protocol

from kvfork.server.engine import messages as m
from kvfork.server.engine.api import DoneEvent, MetricRegistry
from kvfork.server.engine.loop.request import Request
from kvfork.server.engine.loop.stats import EngineStats
from kvfork.server.engine.loop.utilization import EngineLoad


class Readings(Protocol):
    """What the gauges read (engine.Engine is one): its stats (all zeros until the model is loaded)."""

    def stats(self) -> EngineStats: ...
    def utilization(self) -> EngineLoad: ...


log = logging.getLogger("kvfork.requests")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineMetrics:
    def __init__(self, registry: MetricRegistry, engine: Readings):
        c, h = registry.counter, registry.histogram
        self.requests = c("requests_total", "requests ended, by finish_reason")
        self.prompt_tokens = c("prompt_tokens_total", "prompt tokens of ended requests")
        self.reused_tokens = c("reused_tokens_total", "prompt tokens not prefilled, by source (cache, donor, session)")
        self.prefilled_tokens = c("prefilled_tokens_total", "prompt tokens run through the model")
        self.generated_tokens = c("generated_tokens_total", "tokens generated")
        self.ttft = h("time_to_first_token_seconds", "submit to first token", _LATENCY_BUCKETS)
        self.token_gap = h("inter_token_seconds", "time between two tokens of one request", _TOKEN_GAP_BUCKETS)
        self.queue_wait = h("queue_wait_seconds", "submit to admission into a slot", _LATENCY_BUCKETS)
        # in tokens, vLLM's prefix_cache_queries/_hits are server/watch/observe.py's; these count admissions
        self.cache_admissions = c("prefix_cache_admissions_total", "anonymous admissions, by outcome: hit (a prefix "
                                  "cache snapshot served it) or miss")
        self.captures = c("prefix_cache_captures_total", "prompt snapshots, by outcome (stored, refused, failed, skipped)")
        self.clone_attempts = c("clone_attempts_total", "clones tried, by source (cache, donor)")
        self.clone_successes = c("clone_successes_total", "clones that worked, by source")
        self.clone_refusals = c("clone_refusals_total", "clones refused, by source and reason")
        self.donor_saved = c("active_reuse_saved_tokens_total",
                             "prefill tokens active reuse saved beyond the best cached match")
        self.preemptions = c("preemptions_total", "decoding requests paused to give their slot to a tenant below "
                             "its share (fair_share.preempt)")
        self.images_encoded = c("images_encoded_total", "images a vision model's tower encoded (an image reused "
                                 "in a prompt's state, or in the encoder cache of its tenant, is not)")
        self.follow = c("follow_decisions_total", "reuse decisions for anonymous requests, by choice")
        self.step_seconds = c("runner_step_seconds_total", "wall time of runner steps")
        self.backend_seconds = c("runner_backend_seconds_total", "time of runner steps spent in backend calls")
        self.steps = c("runner_steps_total", "runner steps")
        self.control_seconds = c("control_loop_seconds_total", "time the control loop spent on runner events")
        self.budget_exceeded = c("kv_budget_exceeded_total",
                                 "runner reports (each step) in which the backend held more than --kv-budget-bytes")
        self.disk_decisions = c("prefix_cache_disk_decisions_total",
                                "disk tier hits, by the cost model's choice (restore, slower, no_gain)")
        self.disk_restores = c("prefix_cache_disk_restores_total",
                               "disk tier restores, by outcome (restored, corrupt, missing, failed)")
        self.reuse_errors = c("reuse_errors_total", "lookups, choices or uses of reuse that raised, by stage "
                              "(placement, disk); each request prefilled instead")
        self.spec_drafted = c("spec_drafted_tokens_total", "tokens drafted for speculative decoding, by source "
                              "(prompt, suffix)")
        self.spec_accepted = c("spec_accepted_tokens_total", "of them, accepted by verification (each a token "
                               "generated without a pass of its own), by source")
        # running totals as steps and tokens happen (the counters above count requests as they end): the
        # stats line's throughput (server/watch/observe.py)
        self.prefilled_now = 0
        self.generated_now = 0
        self._gauges(registry, engine)

    @staticmethod
    def _gauges(registry: MetricRegistry, engine: Readings) -> None:
        """Gauges read at scrape time: 0 for what is not there yet (before the model loads, no disk tier)."""
        g = registry.gauge

        def stat(read):
            return lambda: read(engine.stats())

        g("queue_depth", "requests waiting for a slot", stat(lambda s: s.queued))
        g("following_requests", "requests parked behind a prefilling leader", stat(lambda s: s.following))
        g("running_requests", "requests holding an inference slot", stat(lambda s: s.slots_used))
        # The Gateway API Inference Extension's model-server protocol: TotalQueuedRequests, TotalRunningRequests
        # (running_requests above) and KVCacheUtilization, in vLLM's meaning (docs/cluster.md).
        g("waiting_requests", "requests waiting: queued for a slot, or parked behind a prefilling leader",
          lambda: engine.utilization().waiting)
        g("kv_cache_usage_perc", "fraction of the KV budget in use, 0 to 1 (the prefix cache and idle named "
          "sessions give way, so they are not counted)", lambda: engine.utilization().kv_usage)
        g("live_sessions", "backend sessions open", stat(lambda s: s.live_sessions))
        g("kv_bytes", "bytes of KV state the backend holds", stat(lambda s: s.total_bytes))
        g("kv_budget_held_bytes", "bytes of the KV budget held: reservations, prefix cache, idle named sessions, "
          "pooled blocks (compare kv_bytes)", stat(lambda s: s.held))
        g("kv_pooled_bytes", "bytes of KV blocks whose writer is gone that other sessions still read",
          stat(lambda s: s.pooled))

        def blocks(read):  # a gauge over the backend's blocks, 0 for a backend without them
            return stat(lambda s: read(s.blocks) if s.blocks is not None else 0)

        g("kv_blocks", "blocks of full-attention KV held, each counted once", blocks(lambda b: b.blocks))
        g("kv_blocks_shared", "blocks held by more than one session, cache entry or named session",
          blocks(lambda b: b.shared))
        g("kv_bytes_saved_by_sharing", "bytes copying clones would hold beyond what sharing holds",
          blocks(lambda b: b.saved_bytes))
        g("kv_reserved_bytes", "bytes of the KV budget reserved by requests and captures",
          stat(lambda s: s.reserved))
        g("named_sessions", "named sessions kept", stat(lambda s: s.named_sessions))
        g("prefix_cache_entries", "snapshots in the prefix cache", stat(lambda s: s.cached))
        g("prefix_cache_bytes", "bytes of the prefix cache", stat(lambda s: s.cached_bytes))

        g("prefix_cache_disk_entries", "files in the prefix cache's disk tier", stat(lambda s: s.on_disk))
        g("prefix_cache_disk_bytes", "bytes of the prefix cache's disk tier", stat(lambda s: s.disk_bytes))
        g("prefix_cache_disk_on", "1 while the disk tier is on", stat(lambda s: int(s.disk_on)))
        g("prefix_cache_disk_spilled", "entries written to the disk tier since start", stat(lambda s: s.disk_spilled))
        registry.counter_view("disk_corrupt_files_total", "disk tier files found torn, corrupt or malformed and "
                              "removed", stat(lambda s: s.disk_corrupt))
        g("prefix_cache_disk_spilling_bytes", "bytes of evicted entries held until their file is written",
          stat(lambda s: s.spilling))

    def holding(self, backend_bytes: int, budget: int | None) -> None:
        """The runner's report of what the backend holds, checked against the budget."""
        if budget is not None and backend_bytes > budget:
            self.budget_exceeded.inc()

    def step(self, stats: m.StepStats) -> None:
        self.prefilled_now += stats.prefill_tokens
        self.steps.inc()
        self.step_seconds.inc(stats.step_s)
        self.backend_seconds.inc(stats.backend_s)

    def token(self, request: Request, now: float) -> None:
        self.generated_now += 1
        if request.last_token_at:
            self.token_gap.observe(now - request.last_token_at)
        else:
            self.ttft.observe(now - request.submitted_at)

    def clone(self, source: str, refused: list[str], success: bool) -> None:
        for reason in refused:
            self.clone_attempts.inc(source=source)
            self.clone_refusals.inc(source=source, reason=reason)
        if success:
            self.clone_attempts.inc(source=source)
            self.clone_successes.inc(source=source)

    def speculated(self, request: Request, counts: dict[str, tuple[int, int]]) -> None:
        """An ended request's drafted and accepted tokens by source; what speculation saved goes on its log line."""
        for source, (drafted, accepted) in counts.items():
            self.spec_drafted.inc(drafted, source=source)
            self.spec_accepted.inc(accepted, source=source)
        if counts:
            request.decision["speculation_saved_tokens"] = sum(accepted for _, accepted in counts.values())

    def done(self, request: Request, event: DoneEvent) -> None:
        usage = event.usage
        self.requests.inc(finish_reason=event.finish_reason)
        self.prompt_tokens.inc(usage.prompt_tokens)
        if usage.reused_tokens:
            self.reused_tokens.inc(usage.reused_tokens, source=usage.reuse_source or "cache")
        self.prefilled_tokens.inc(usage.prefilled_tokens)
        self.generated_tokens.inc(usage.generated_tokens)
        fields = {
            "request_id": request.req.request_id,
            "finish_reason": event.finish_reason,
            "tenant": request.req.scope.tenant_hash,  # a hash: never the tenant's name or key
            "session": request.req.session_id,
            "prompt_tokens": usage.prompt_tokens,
            "reused_tokens": usage.reused_tokens,
            "reuse_source": usage.reuse_source,
            "prefilled_tokens": usage.prefilled_tokens,
            "generated_tokens": usage.generated_tokens,
            "queue_s": round(usage.queue_s, 4),
            "prefill_s": round(usage.prefill_s, 4),
            "ttft_s": round(usage.ttft_s, 4),
            "decode_s": round(usage.decode_s, 4),
            **request.decision,
        }
        if event.error:
            fields["error"] = event.error
        log.info("request %s", json.dumps(fields, separators=(",", ":")))
