"""What /v1/models, /health and /metrics say of a daemon serving several models."""

from __future__ import annotations

import re
from typing import Any

from kvfork.server.api.openai import ModelCard
from kvfork.server.pool.pool import ModelPool
from kvfork.server.watch.metrics import Registry

_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})? (.*)$")


class PoolModelCard(ModelCard, kw_only=True):
    loaded: bool = False  # in memory now; a request for a model not loaded waits for its load
    pinned: bool = False  # --pin: never unloaded for another model


def pool_cards(pool: ModelPool, created: int) -> dict[str, Any]:
    cards = [PoolModelCard(name, created, max_model_len=known.context if (known := pool.known(name)) else None,
                           loaded=model.ready, pinned=model.pinned) for name, model in pool.models.items()]
    return {"object": "list", "data": cards}


def pool_health(pool: ModelPool, detailed: bool) -> dict[str, Any]:
    """Each model's state; a failed load's own error (its paths, a parser's words) only where `detailed` (the
    caller holds --metrics-key), else that it failed."""
    models = {name: {"loaded": model.ready, "error": model.error if model.error is None or detailed else model.refusal}
              for name, model in pool.models.items()}
    return {"status": "ok", "phase": "ready", "memory_budget_bytes": pool.budget.total_bytes, "loading": pool.loading,
            "models": models}


def pool_metrics(pool: ModelPool) -> str:
    """The daemon's metrics, then each loaded model's under its `model_name` label (vLLM's), one family per
    name whichever models have it."""
    lines = pool.registry.render().splitlines()
    families: dict[str, list[str]] = {}
    for model in pool.models.values():
        if model.served is not None:
            _labelled(model.served.registry, model.spec.name, families)
    for rows in families.values():
        lines += rows
    return "\n".join(lines) + "\n"


def _labelled(registry: Registry, name: str, families: dict[str, list[str]]) -> None:
    for metric in registry.metrics.values():
        rows = metric.render()
        family = families.setdefault(metric.name, rows[:2])
        for row in rows[2:]:
            m = _SAMPLE.match(row)
            if m is None or "model_name=" in (m.group(2) or ""):
                family.append(row)
                continue
            labels = f'model_name="{name}"' + (f",{m.group(2)}" if m.group(2) else "")
            family.append(f"{m.group(1)}{{{labels}}} {m.group(3)}")
