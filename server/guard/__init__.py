"""Guarding the door: what every request passes before any work (who it is, what it may ask, slow or cross-site
clients, refusals, errors in the API's shape, tenants' fair worker threads).

- slow_clients.py: Slow clients: a connection may not hold the daemon open by sending or reading too slowly
- origin_guard.py: The Origin and Host guard: a web page may not drive the daemon, unless the operator allows
  its origin
- refusals.py: Refusals are rate-limited: a client that sends request after bad request is slowed, not the
  others
- tenants.py: Tenants: who a request is, by the API key that authenticated it
- limits.py: What one request may ask for: every limit in one table, checked before any work starts
- errors.py: Every failure the client sees, in OpenAI's shape: {"error": {message, type, param, code}}
- fair_workers.py: Worker threads shared by tenants in turn: one tenant's queue of long jobs never holds
  another's back
"""
