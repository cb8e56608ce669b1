"""Which models a daemon serves, by name: `--model NAME=PATH` (or a bare PATH, named by its folder) repeated,
and `--models-dir DIR` (each model folder, or each Hugging Face hub cache entry, in it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvfork.server.watch.start_progress import StartProgress

Fetch = Callable[[StartProgress], str]  # downloads (converts) a model, reporting its phases; its folder
Source = Callable[[str], tuple[str, Fetch | None]]  # a model's name or path -> its folder, and how to fetch it first


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what a request's `model` says
    path: str  # the folder, or the hub id while `fetch` is still to run
    fetch: Fetch | None = None  # how to download it first (on its first load)


def _named(value: str) -> tuple[str, str]:
    """`NAME=PATH` or a bare PATH (named by its last part); a path holding `=` is given as NAME=PATH."""
    name, eq, path = value.partition("=")
    if eq and name and "/" not in name:
        return name, path
    return Path(value.rstrip("/")).name.split(":")[0], value


def _dir_entries(folder: str) -> list[tuple[str, str]]:
    """Each model folder under `folder` (it holds config.json), and each hub cache entry
    (`models--org--name/snapshots/<rev>`: its newest snapshot), named by the folder or `org/name`."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {folder}: no such folder")
    found = []
    for entry in sorted(root.iterdir()):
        if (entry / "config.json").is_file():
            found.append((entry.name, str(entry)))
        elif entry.name.startswith("models--") and (entry / "snapshots").is_dir():
            snapshots = sorted((entry / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime)
            if snapshots and (snapshots[-1] / "config.json").is_file():
                found.append((entry.name[len("models--"):].replace("--", "/"), str(snapshots[-1])))
    return found


def model_specs(models: list[str], models_dir: str | None, source: Source) -> list[ModelSpec]:
    """Every model served, in the order given, each found by `source` (server/launch/model_source.py's
    `model_source`); ValueError (or FileNotFoundError) names a bad one or a name given twice."""
    named = [_named(m) for m in models] + (_dir_entries(models_dir) if models_dir else [])
    specs: dict[str, ModelSpec] = {}
    for name, path in named:
        if name in specs:
            raise ValueError(f"two models are named {name!r}: name one NAME=PATH")
        folder, fetch = source(path)
        specs[name] = ModelSpec(name, folder, fetch)
    return list(specs.values())


def several(models: list[str], models_dir: str | None) -> bool:
    """Whether the daemon serves several models (a pool) rather than today's one."""
    return len(models) > 1 or models_dir is not None or any("=" in m.split("/")[0] for m in models)


def pool_refusal(config, specs: list[ModelSpec]) -> str | None:
    """Flags that do not combine with several models, and pins naming no model; None: they combine."""
    if config.served_model_name:
        return "--served-model-name names the one model; with several, name each as --model NAME=PATH"
    if config.distributed:
        return "--distributed serves one model split over ranks, not several"
    if config.kv_events_endpoint is not None:
        return "--kv-events-endpoint publishes one model's KV events: serve one model for it"
    names = {s.name for s in specs}
    unknown = [p for p in config.pin if p not in names]
    if unknown:
        return f"--pin {unknown[0]!r}: no model of that name (serving {', '.join(sorted(names))})"
    return None
