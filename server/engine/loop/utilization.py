"""What the engine is carrying right now, as a gateway in front of several replicas reads it.

The engine takes one snapshot (engine.Engine.utilization) for both readers: `GET /v1/loads`
(smg's load-aware policies, routes/loads.py) and the gauges of `/metrics` that the
Gateway API Inference Extension scrapes (telemetry.py). Aggregates only: no prompt,
tenant or session.

Design rule: KV in use is what the budget cannot give back. The prefix cache and
idle named sessions give way to any new request (admission.py), so, as in vLLM
(cached free blocks count as free) and SGLang (evictable radix nodes do not
count as used), they are not load.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    running: int = 0  # requests holding an inference slot
    waiting: int = 0  # requests queued for a slot, and parked behind a prefilling leader
    waiting_prompt_tokens: int = 0  # prompt tokens of the queued requests: prefill work not started
    slots: int = 0  # --inference-slots
    used_tokens: int = 0  # token slots of KV the budget holds and cannot give back
    budget_tokens: int = 0  # token slots the KV budget holds at most (full attention, --kv-budget-bytes)
    reused_fraction: float = 0.0  # prompt tokens not prefilled, over prompt tokens, since start

    def counts_only(self) -> "EngineLoad":
        """The request counts and the fixed sizes alone: what tells no one request's size nor another tenant's
        reuse."""
        return EngineLoad(running=self.running, waiting=self.waiting, slots=self.slots,
                          budget_tokens=self.budget_tokens)

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV budget in use, 0 to 1."""
        return min(1.0, self.used_tokens / self.budget_tokens) if self.budget_tokens else 0.0


class TokenRate:
    """Tokens a second over the last `window_s`, from a running total read when asked (a poll every
    few seconds is enough; nothing runs between polls)."""

    def __init__(self, window_s: float = 30.0, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self.samples: deque[tuple[float, float]] = deque()

    def rate(self, total: float) -> float:
        now = self.clock()
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()  # keep one sample at least window_s old, as the base
        t0, base = self.samples[0]
        return (total - base) / (now - t0) if now > t0 else 0.0
