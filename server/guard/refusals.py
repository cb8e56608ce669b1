"""Refusals are rate-limited: a client that sends request after bad request is slowed, not the others.

A 4xx costs the daemon little, but a flood of them (tens of thousands of malformed bodies a minute)
still takes the event loop from every other tenant's streams. Each 4xx answer (but a 429) draws from
a token bucket: the tenant's (a keyed daemon's authenticated request), else the client address's (an
authentication failure, or any request to a keyless daemon: on loopback every client shares one
address, so there keyed tenants carry the fairness). A request whose bucket is empty is answered 429
after a pause (--refusal-rate): the client's own connection waits, the loop does not, and a client
that keeps a fixed number of requests in flight is slowed to that many a pause.
"""

from __future__ import annotations

import time
from typing import Callable

PAUSE_S = 1.0  # how long an over-limit request waits for its 429
BURST_S = 10.0  # a bucket holds this many seconds' worth of refusals
_PRUNE_AT = 10_000  # buckets kept before the full ones (clients quiet long enough) are dropped


class RefusalLimiter:
    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.burst, self.clock = rate, max(1.0, rate * BURST_S), clock
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # key -> (tokens, when)

    def _tokens(self, key: tuple[str, str]) -> float:
        tokens, when = self._buckets.get(key, (self.burst, 0.0))
        return min(self.burst, tokens + (self.clock() - when) * self.rate)

    def over(self, key: tuple[str, str]) -> bool:
        """Whether `key` has drawn every refusal its bucket holds."""
        return self._tokens(key) < 1.0

    def refused(self, key: tuple[str, str]) -> None:
        """`key` got a 4xx: one token less."""
        if len(self._buckets) >= _PRUNE_AT:
            self._buckets = {k: v for k, v in self._buckets.items() if self._tokens(k) < self.burst}
        self._buckets[key] = (self._tokens(key) - 1.0, self.clock())
