"""Watching: metrics, the stats line, KV events for routers, the reuse page's view and the start's progress.

- metrics.py: Prometheus text exposition without a dependency: counters, gauges, histograms
- observe.py: Observability in the field's terms: vLLM's metric names and units where the meaning is the same
  (under kvfork's prefix, with vLLM's `model_name` label), and a stats line every 10 s while the daemon is
  busy, as vLLM prints one
- kv_events.py: KV events in vLLM's format, for routers that route on the KV state replicas really hold
- reuse.py: What the reuse page (`/`) and its JSON (`GET /debug/reuse`) show: what is cached now, as a tree of
  shared prefixes; the live requests and whom they clone from or follow; named sessions; the last placement
  decisions with the prefill tokens each saved; hit rate and tokens saved over time
- start_progress.py: Where a start is: the phase (`/health` names it while it lasts) and its display, a line
  redrawn in place with the time spent on a terminal, a log line when a phase starts and every LOG_EVERY_S
  otherwise
"""
