"""The control loop's state machine: the engine, requests and their phases, admission and the KV budget, and the
views and metrics it publishes.

- engine.py: The engine: the control loop's side of the daemon, over the runner thread that owns the model
- serving.py: The engine's state machine over requests, built once the model has loaded (engine.py builds it
  from the runner's Loaded event; before that the engine serves nothing): its managers exist from the start
- request.py: One request as the control loop sees it: what every phase shares, and a state per phase
- placing.py: The view a request is placed over (policy/placement.py's `View`), taken from what the engine has:
  its requests, the parked followers, the index, the measured rates
- admission.py: Admission: the KV budget and the queue, on the control loop
- parking.py: The parked phases, Following and Restoring: a request that waits for a session to be handed to
  it, holding the bytes of that session and no slot (request.py), and the runner's answers that end the wait
- progress.py: The running phases, Prefilling, Decoding and Paused: the runner's events about a request it
  runs (its start, its tokens, its capture, the positions it committed) and about the whole batch (the bytes
  it holds, a spill's state)
- ending.py: The last phase, Finished: a request asked to end (cancelled, a stop string, its queue timeout) or
  ended by the runner, and everything it held going back
- ledger.py: The loop's ledger of the runner's bytes: what the budget counts that no request, capture, cache
  entry or named session holds on the loop, because the runner holds it or has not yet run what the loop asked
- loans.py: Bytes of an engine's KV budget lent to something outside it while the engine does not need them: a
  pool's model kept for its next load (server/pool/kept.py) lives in the KV budget of the model loaded in its
  place
- stats.py: What the engine holds at one moment, as one frozen value: `Engine.stats()` (made by
  `Serving.stats`)
- utilization.py: What the engine is carrying right now, as a gateway in front of several replicas reads it
- telemetry.py: The engine's metrics and its one structured log line per request
"""
