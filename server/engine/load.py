"""What the engine is carrying right now, as a gateway in front of several replicas reads it.

One snapshot feeds both readers: `GET /v1/loads` (smg's load-aware policies,
routes/loads.py) and the gauges of `/metrics` that the Gateway API Inference
Extension scrapes (telemetry.py). Aggregates only: no prompt, tenant or session.

Design rule: KV in use is what the budget cannot give back. The prefix cache and
idle named sessions give way to any new request (admission.py), so, as in vLLM
(cached free blocks count as free) and SGLang (evictable radix nodes do not
count as used), they are not load.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from server.engine.engine import Engine


@dataclass(frozen=True)
class EngineLoad:
    running: int = 0  # requests holding an inference slot
    waiting: int = 0  # requests queued for a slot, and parked behind a prefilling leader
    waiting_prompt_tokens: int = 0  # prompt tokens of the queued requests: prefill work not started
    slots: int = 0  # --inference-slots
    used_tokens: int = 0  # token slots of KV the budget holds and cannot give back
    budget_tokens: int = 0  # token slots the KV budget holds at most (full attention, --kv-budget-bytes)
    reused_fraction: float = 0.0  # prompt tokens not prefilled, over prompt tokens, since start

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV budget in use, 0 to 1."""
        return min(1.0, self.used_tokens / self.budget_tokens) if self.budget_tokens else 0.0


def engine_load(engine: Engine) -> EngineLoad:
    """The snapshot now; all zeros until the model is loaded."""
    adm, info = engine.admission, engine.info
    if adm is None or info is None:
        return EngineLoad()
    per_token = max(1, info.kv.full_bytes_per_token)
    pinned = max(0, adm.held() - adm.cache.nbytes - adm.named.idle_bytes())
    prompts = engine.metrics.prompt_tokens.get()
    reused = sum(engine.metrics.reused_tokens.values.values())
    return EngineLoad(
        running=adm.slots_used,
        waiting=engine.waiting(),
        waiting_prompt_tokens=sum(len(r.prompt) for r in adm.queue),
        slots=engine.config.inference_slots,
        used_tokens=pinned // per_token,
        budget_tokens=adm.budget // per_token,
        reused_fraction=reused / prompts if prompts else 0.0,
    )


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
