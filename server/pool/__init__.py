"""Several models in one daemon: each its own engine, runner and backend, loaded on demand under one memory
budget (docs/models.md)."""
