"""Observability in the field's terms: vLLM's metric names and units where the meaning is the same (under
kvfork's prefix, with vLLM's `model_name` label), and a stats line every 10 s while the daemon is busy, as
vLLM prints one.

vLLM's names (its `vllm:` prefix is `kvfork_` here), in tokens and requests as vLLM counts them:
- `prefix_cache_queries_total`, `prefix_cache_hits_total`: prompt tokens of ended requests, and those of
  them not prefilled (reused from the prefix cache, a running donor, a named session or the disk tier);
  their ratio is the prefix hit rate in tokens, the same ratio vLLM's dashboards plot;
- `num_requests_running`, `num_requests_waiting`: requests holding an inference slot, and waiting for
  one (queued, or parked behind a prefilling leader);
- `spec_decode_num_draft_tokens_total`, `spec_decode_num_accepted_tokens_total`: speculative decoding's
  drafted and accepted tokens (kvfork's own `spec_drafted_tokens_total{source}` splits them by drafter).
kvfork's own names stay for what only kvfork has (clones, following, the disk tier, admissions the
prefix cache served: `prefix_cache_admissions_total`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvfork.server.watch.metrics import Registry

STATS_INTERVAL_S = 10.0

log = logging.getLogger("kvfork.stats")


def register_vllm_names(registry: Registry, engine: Any, model_name: str) -> None:
    """The gauges and counters vLLM names so, read from the engine when scraped."""
    labels = (("model_name", model_name),)

    def metrics(read):
        return lambda: read(engine.metrics)

    registry.counter_view("prefix_cache_queries_total", "prompt tokens of ended requests (vLLM's "
                          "prefix_cache_queries)", metrics(lambda m: sum(m.prompt_tokens.values.values())), labels)
    registry.counter_view("prefix_cache_hits_total", "of them, prompt tokens reused rather than prefilled "
                          "(vLLM's prefix_cache_hits)", metrics(lambda m: sum(m.reused_tokens.values.values())), labels)
    registry.counter_view("spec_decode_num_draft_tokens_total", "tokens drafted for speculative decoding (vLLM's "
                          "spec_decode_num_draft_tokens)", metrics(lambda m: sum(m.spec_drafted.values.values())), labels)
    registry.counter_view("spec_decode_num_accepted_tokens_total", "of them, accepted (vLLM's "
                          "spec_decode_num_accepted_tokens)", metrics(lambda m: sum(m.spec_accepted.values.values())),
                          labels)
    registry.gauge("num_requests_running", "requests holding an inference slot (vLLM's num_requests_running)",
                   lambda: engine.utilization().running, labels)
    registry.gauge("num_requests_waiting", "requests waiting for a slot: queued, or parked behind a prefilling "
                   "leader (vLLM's num_requests_waiting)", lambda: engine.utilization().waiting, labels)


@dataclass
class Totals:
    at: float
    prefilled: int  # tokens prefilled, as steps ran
    generated: int  # tokens generated, as they were sampled
    prompt: float  # prompt tokens of ended requests
    reused: float  # of them, reused


def totals(engine: Any) -> Totals:
    m = engine.metrics
    return Totals(time.monotonic(), m.prefilled_now, m.generated_now, sum(m.prompt_tokens.values.values()),
                  sum(m.reused_tokens.values.values()))


def stats_line(before: Totals, now: Totals, engine: Any) -> str | None:
    """The line for the interval from `before` to `now`; None when the daemon was idle all along."""
    load = engine.utilization()
    moved = (now.prefilled, now.generated, now.prompt) != (before.prefilled, before.generated, before.prompt)
    if not moved and not load.running and not load.waiting:
        return None
    span = max(now.at - before.at, 1e-9)
    prompt = now.prompt - before.prompt
    hit = f"{100 * (now.reused - before.reused) / prompt:.1f}%" if prompt else "-"
    return (f"prompt throughput {(now.prefilled - before.prefilled) / span:.1f} tokens/s, generation throughput "
            f"{(now.generated - before.generated) / span:.1f} tokens/s, running {load.running}, waiting "
            f"{load.waiting}, KV in use {100 * load.kv_usage:.1f}%, prefix cache hit rate {hit} (tokens)")


async def log_stats(engine: Any, interval_s: float = STATS_INTERVAL_S) -> None:
    """Every `interval_s`, the stats line, while the daemon is busy (runs until cancelled)."""
    before = totals(engine)
    while True:
        await asyncio.sleep(interval_s)
        now = totals(engine)
        line = stats_line(before, now, engine)
        if line is not None:
            log.info("%s", line)
        before = now
