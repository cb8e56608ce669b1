"""One memory budget for every loaded model's weights and KV.

The budget: --memory-budget-bytes, else the device's rule of docs/kv-budget.md before any weights are loaded
(what the device holds less its headroom). A model takes its weights (the size of its weight files) and its
KV budget: --kv-budget-bytes when given, else an equal share of the budget among the models that may be
loaded at once (--max-loaded-models, else every model served) less its weights; a model that reads images
takes its encoder cache (--encoder-cache-bytes) too, out of that share. A model fits when the
footprints of the loaded models, the weights kept of closed ones and its own sum to the budget at most, and
fewer than --max-loaded-models are loaded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvfork.backends.device_memory import DeviceMemory, weights_on_disk
from kvfork.backends.vision import folder_family
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.policy.memory_plan import plan_memory
from kvfork.server.pool.specs import ModelSpec

GiB = 1024**3


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class PoolBudget:
    total_bytes: int
    reason: str  # where the figure comes from
    max_loaded: int  # 0: as many as the bytes hold
    kv_bytes: int | None  # --kv-budget-bytes: each model's KV budget
    sharers: int  # models that may be loaded at once, for the default KV share
    encoder_cache_bytes: int = 0  # --encoder-cache-bytes: what a model that reads images keeps beside its KV

    @classmethod
    def of(cls, device: DeviceMemory, engine: EngineConfig, total: int | None, max_loaded: int,
           models: int) -> PoolBudget:
        if total is None:
            plan = plan_memory(device, kv_budget_bytes=None, gpu_memory_utilization=engine.gpu_memory_utilization,
                               request_bytes=0)
            total, reason = plan.available_bytes, plan.reason
        else:
            reason = "--memory-budget-bytes"
        return cls(total, reason, max_loaded, engine.kv_budget_bytes, max_loaded or models, engine.encoder_cache_bytes)

    def weights(self, spec: ModelSpec) -> int:
        return weights_on_disk(spec.path) if spec.fetch is None else 0

    def encoder_cache(self, spec: ModelSpec) -> int:
        reads_images = spec.fetch is None and folder_family(Path(spec.path).expanduser()) is not None
        return self.encoder_cache_bytes if reads_images else 0

    def kv(self, spec: ModelSpec) -> int:
        if self.kv_bytes is not None:
            return self.kv_bytes
        return max(0, self.total_bytes // self.sharers - self.weights(spec) - self.encoder_cache(spec))

    def footprint(self, spec: ModelSpec) -> int:
        return self.weights(spec) + self.kv(spec) + self.encoder_cache(spec)

    def engine_config(self, config: EngineConfig, spec: ModelSpec) -> EngineConfig:
        """The model's engine settings: the daemon's, with the model's KV budget."""
        return dataclasses.replace(config, kv_budget_bytes=self.kv(spec))

    def fits(self, need: int, loaded: list[int], kept: int = 0) -> bool:
        """Whether `need` bytes more fit beside the loaded models' footprints and `kept` bytes of closed models'
        weights kept for their next load (pool.py), within the count of --max-loaded-models."""
        return self.holds(need, loaded, kept) and not (self.max_loaded and len(loaded) >= self.max_loaded)

    def holds(self, need: int, loaded: list[int], kept: int = 0) -> bool:
        """Whether the bytes fit, whatever the count (kept weights are not loaded models)."""
        return sum(loaded) + kept + need <= self.total_bytes

    def refusal(self, need: int, pinned: list[int]) -> str:
        """Why a model of `need` bytes cannot be loaded beside the pinned models' `pinned` bytes."""
        held = f" beside pinned models holding {_gib(sum(pinned))}" if pinned else ""
        return (f"it takes {_gib(need)} (weights and KV), more than the memory budget of "
                f"{_gib(self.total_bytes)} ({self.reason}) holds{held}")

    def describe(self, need: int) -> str:
        return f"{_gib(need)} of the {_gib(self.total_bytes)} memory budget"
