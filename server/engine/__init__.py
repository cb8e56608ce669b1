"""The engine: continuous batching over one backend, never prefilling the same prefix twice.

Where things happen (docs/architecture.md walks one request through them):
- api.py: the engine <-> daemon contract (requests in, events out);
- engine.py: the state machine over requests, on the control loop: submit, admit, place,
  the runner's events, ends;
- request.py: one request, a state per phase, and the transitions between them;
- placement.py: where a request starts from, a pure decision (`place`);
- admission.py: the KV budget and the queue, with narrow verbs;
- index.py: every reusable state (prefix cache, disk tier files, named sessions, running
  requests) in one trie, with one lookup (`Index.best`);
- sessions.py: named sessions; disk.py: the prefix cache's disk tier (files, a worker thread);
- runner.py: the thread that owns the backend; `Runner.step` takes commands, plans, runs the
  forward pass, samples and publishes; plan.py: the step's plan, a plain value of
  backends/effects.py's effects;
  faults.py: failures recovered row by row; clone_orders.py: followers' clone orders;
  constraints.py: grammar masks;
- the pure policies: matching.py, follow.py, scheduler.py, restore.py, rates.py;
- messages.py: what the loop and the runner send each other;
- telemetry.py: metrics and the per-request log line; config.py: every engine flag.
"""
