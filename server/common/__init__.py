"""What the routes share: the daemon's flags and the state every route reads.

- config.py: The daemon's own flags (the engine's are in server/engine/config.py); see server/settings.py
- state.py: What every route reads: the daemon's `Services` (one per process, on the application under SERVICES) and
  a model's `ModelState` (its engine, tokenizer and formats), which the services' `Models` hand a request
"""
