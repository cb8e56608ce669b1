"""Watching: metrics, the stats line, KV events for routers and the reuse page's view.

- metrics.py: Prometheus text exposition without a dependency: counters, gauges, histograms
- observe.py: Observability in the field's terms: vLLM's metric names and units where the meaning is the same
  (under kvfork's prefix, with vLLM's `model_name` label), and a stats line every 10 s while the daemon is
  busy, as vLLM prints one
- kv_events.py: KV events in vLLM's format, for routers that route on the KV state replicas really hold
- reuse.py: What the reuse page (`/`) and its JSON (`GET /debug/reuse`) show: what is cached now, as a tree of
  shared prefixes; the live requests and whom they clone from or follow; named sessions; the last placement
  decisions with the prefill tokens each saved; hit rate and tokens saved over time
"""
