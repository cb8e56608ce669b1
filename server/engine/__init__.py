"""The engine: continuous batching over one backend, never prefilling the same prefix twice.

Where things happen (docs/architecture.md walks one request through them):
- api.py: the engine <-> daemon contract (requests in, events out);
- engine.py: the lifecycle (the runner thread, load, failure, shutdown) and `Engine.snapshot()`
  (snapshot.py); serving.py: the state machine over requests, built once the model has loaded:
  submit, admit, place; the runner's events go to its parts, objects with their own state, by the
  phases they move: parking.py (Following, Restoring), progress.py (Prefilling, Decoding),
  ending.py (Finished);
- request.py: one request, a state per phase, and the transitions between them;
- placement.py: where a request starts from, a pure decision (`place`);
- admission.py: the KV budget and the queue, with narrow verbs; ledger.py: the runner's bytes as the
  loop sees them; loans.py: budget bytes lent outside the engine;
- index.py: every reusable state (prefix cache, disk tier files, named sessions, running
  requests) in one trie, with one lookup (`Index.best`);
- sessions.py: named sessions; disk.py: the prefix cache's disk tier (files, a worker thread);
- runner.py: the thread that owns the backend; `Runner.step` takes commands, plans, runs the
  forward pass, samples and publishes; its parts, built once the model is loaded: commands.py (the
  loop's commands), cloning.py (clones of running sessions, with clone_orders.py: followers' clone
  orders), speculation.py (drafting and verifying, with drafts.py: the drafters); sequence.py: a
  request as the runner runs it; plan.py: the step's plan, a plain value of backends/effects.py's
  effects; faults.py: failures recovered row by row; constraints.py: grammar masks;
- the pure policies: matching.py, follow.py, scheduler.py, restore.py, rates.py, fair_share.py,
  draft_policy.py, memory_plan.py;
- messages.py: what the loop and the runner send each other;
- telemetry.py: metrics and the per-request log line; utilization.py: what the engine carries, for a
  gateway; config.py: every engine flag.
"""
