"""The engine: continuous batching over one backend, never prefilling the same prefix twice.

Its contracts, here:
- api.py: the engine <-> daemon contract (requests in, events out);
- config.py: every engine flag;
- messages.py: what the loop and the runner send each other.

Its rooms (docs/architecture.md walks one request through them; each room's __init__ lists its modules):
- loop/: the control loop's state machine. engine.py: the lifecycle (the runner thread, load, failure,
  shutdown) and `Engine.stats()` (stats.py); serving.py: the state machine over requests, built once
  the model has loaded; its parts, objects with their own state, by the phases they move: parking.py
  (Following, Restoring), progress.py (Prefilling, Decoding), ending.py (Finished); request.py: one request, a state per phase;
  admission.py: the KV budget and the queue; ledger.py, loans.py: bytes the runner holds or a pool borrows;
  telemetry.py, utilization.py: metrics, the per-request log line, the load a gateway reads;
- worker/: the runner thread. runner.py: `Runner.step` takes commands, plans, runs the forward pass,
  samples and publishes; commands.py, cloning.py, speculation.py (and drafts.py, the drafters),
  constraints.py (grammar masks), sequence.py (a request in a slot), clone_orders.py, plan.py (the step
  as a value of backends/effects.py's effects), faults.py (failures recovered row by row);
- cache/: the tiers. index.py: every reusable state (prefix cache, disk tier files, named sessions, running
  requests) in one trie, one lookup (`Index.best`); disk.py: the disk tier; sessions.py: named sessions;
- policy/: pure policies. placement.py (`place`), matching.py, follow.py, rates.py, restore.py,
  scheduler.py, draft_policy.py, fair_share.py, memory_plan.py; entries.py: the index's entries and what a lookup
  finds, the values they read.
"""
