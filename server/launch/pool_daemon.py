"""The daemon serving several models (`--model NAME=PATH` repeated, `--models-dir`): the listener and the
routes of `Daemon` (server/launch/serve.py), the models in a `ModelPool`. `run` drives either the same way."""

from __future__ import annotations

import sys
from typing import Callable

from kvfork.backends.base import Backend
from kvfork.backends.device_memory import DeviceMemory, cpu_memory
from kvfork.server.common.config import ServerConfig
from kvfork.server.common.state import Services
from kvfork.server.engine.config import EngineConfig
from kvfork.server.launch.listening import Listening
from kvfork.server.launch.model_load import Loader
from kvfork.server.pool.budget import PoolBudget
from kvfork.server.pool.pool import ModelPool
from kvfork.server.pool.specs import ModelSpec
from kvfork.server.watch.metrics import Registry


def device_reading(backend: str) -> DeviceMemory:
    """What the device holds before any model is loaded: the budget's starting point."""
    if backend == "mlx" and sys.platform == "darwin":
        from kvfork.backends.device_memory import metal_memory

        return metal_memory(0)
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            from kvfork.backends.device_memory import cuda_memory

            return cuda_memory(torch.device("cuda"), 0, 0)
    return cpu_memory(0)


class PoolDaemon(Listening):
    def __init__(self, config: ServerConfig, engine_config: EngineConfig, specs: list[ModelSpec],
                 backend: str, make_backend: Callable[[], Backend]):
        """`backend`: the backend's name ("mlx" loads one model at a time); `make_backend`: a fresh one per load."""
        self.config = config
        self.registry = Registry()
        self.kv_events = None
        max_loaded = 1 if backend == "mlx" else config.max_loaded_models
        budget = PoolBudget.of(device_reading(backend), engine_config, config.memory_budget_bytes, max_loaded,
                               len(specs))
        self.pool = ModelPool(config, self.registry, specs, engine_config, Loader(config, make_backend), budget)
        self.services = Services(config, self.registry, self.pool)
        self.speculative = engine_config.speculative
        self.port = config.port

    async def load(self) -> None:
        """Load the pinned models (else the first), as a daemon of one model loads it before it is ready."""
        if not self.memory_fits():
            raise ValueError("a model does not fit the memory budget (above)")
        self.pool.start()
        first = [s for s in self.pool.models.values() if s.pinned] or [self.pool.model(None)]
        for model in first:
            await self.pool.take(model)
            self.pool.release(model)

    def memory_fits(self) -> bool:
        """Whether each model fits the budget alone, and the pinned ones together (else why not, on stderr)."""
        budget, models = self.pool.budget, list(self.pool.models.values())
        pinned = [s.footprint for s in models if s.pinned]
        for model in models:
            if not budget.fits(model.footprint, []) or (model.pinned and not budget.fits(0, pinned)):
                refusal = budget.refusal(model.footprint, [p for p in pinned if not model.pinned])
                print(f"kvfork serve: error: model {model.spec.name!r} cannot be served: {refusal}", file=sys.stderr,
                      flush=True)
                return False
        return True

    def loaded_line(self) -> str:
        budget = self.pool.budget
        names = ", ".join(f"{s.spec.name}{' (loaded)' if s.served else ''}{' (pinned)' if s.pinned else ''}"
                          for s in self.pool.models.values())
        cap = f", at most {budget.max_loaded} loaded" if budget.max_loaded else ""
        return (f"kvfork: serving {len(self.pool.models)} models: {names}\n"
                f"kvfork: memory budget {budget.total_bytes / 1024**3:.2f} GiB for weights and KV: "
                f"{budget.reason}{cap}\n"
                f"kvfork: speculative decoding {self._speculation()}")

    def _speculation(self) -> str:
        if self.speculative == "off":
            return "off"
        return f"{self.speculative} on each model that can roll drafted tokens back (--speculative off turns it off)"

    async def close(self) -> None:
        await self.pool.shutdown(self.config.shutdown_grace)
        if self.listener is not None:
            await self.listener.close()
        self.services.close()
