"""GET /v1/loads: the engine's load in smg's `WorkerLoadResponse` shape (SGLang's /v1/loads).

smg polls `GET /v1/loads?include=core,disagg,queues,memory` on a generic worker and
feeds its load-aware policies (cache_aware's balance and overload checks,
least_load, power_of_two) from it. One replica is one data-parallel rank. The
`include` sections beyond `core` (disaggregation, queues, memory) have nothing
to say for kvfork, so every answer is the core fields; smg reads what it knows.

Open like /health, even with --api-key: smg polls it with no key of a client's. It
says only what /metrics says (counts and fractions, no prompt, tenant or key), but
with one request running, its token count is that request's size, and the hit rate
moves when another tenant's request reuses its earlier prompt. So with --metrics-key
set, a poller without that key gets the request counts alone (enough for smg's load
balancing), and the token and reuse figures read 0; with the key, every field.
"""

from __future__ import annotations

from datetime import datetime, timezone

from aiohttp import web

from kvfork.server.api.respond import json_response
from kvfork.server.common.state import holds_metrics_key, services_of

PATH = "/v1/loads"


async def handle(request: web.Request) -> web.Response:
    services = services_of(request)
    model = services.current()
    load = model.engine.utilization()
    generated = model.engine.metrics.generated_tokens.get() if model.ready else 0.0
    full = not services.metrics_keys or holds_metrics_key(request)
    if not full:
        load = load.counts_only()
    rank = {
        "dp_rank": 0,
        "num_running_reqs": load.running,
        "num_waiting_reqs": load.waiting,
        "num_waiting_uncached_tokens": load.waiting_prompt_tokens,
        "num_total_reqs": load.running + load.waiting,
        "num_used_tokens": load.used_tokens,
        "max_total_num_tokens": load.budget_tokens,
        "token_usage": load.kv_usage,
        "gen_throughput": services.generation_rate.rate(generated) if full else 0.0,
        "cache_hit_rate": load.reused_fraction,
        "utilization": load.running / load.slots if load.slots else 0.0,
        "max_running_requests": load.slots,
    }
    return json_response({"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1, "loads": [rank]})
