"""The engine: continuous batching over one backend, with prefix reuse.

Where things happen:
- api.py: the engine <-> daemon contract (requests in, events out);
- engine.py: the facade on the control loop: submit, cancel, sessions, shutdown;
- admission.py: who gets a slot, and what state it starts from (named session,
  prefix cache, donor);
- scheduler.py: the pure step policy (decode first, prefill chunks in rotation);
- runner.py: the thread that owns the backend and runs each step;
- messages.py: what the loop and the runner send each other;
- request.py: one request's phase, handle and accounting;
- prefix_cache.py, sessions.py: the stores of reusable state;
- telemetry.py: metrics and the per-request log line.
"""
