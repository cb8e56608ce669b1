"""The engine: continuous batching over one backend, never prefilling the same prefix twice.

Where things happen:
- api.py: the engine <-> daemon contract (requests in, events out);
- engine.py: the engine core, one object: start, submit, sessions, shutdown,
  request phases, runner events, streams; its collaborators use only its
  public interface;
- admission.py: who gets a slot and the KV budget; where a request starts from
  (named session, prefix cache, a donor's clone);
- reuse.py: active prefix reuse and following a prefilling leader, wired to the
  pure policies in matching.py, follow.py and rates.py;
- scheduler.py: the pure step policy (decode first, prefill chunks in rotation);
- runner.py: the thread that owns the backend and runs each step; clone_orders.py
  holds followers' clone orders there until their donors are ready;
- messages.py: what the loop and the runner send each other;
- request.py: one request's phase, handle and accounting;
- prefix_cache.py, sessions.py: the stores of reusable state;
- telemetry.py: metrics and the per-request log line;
- config.py: every engine flag.
"""
