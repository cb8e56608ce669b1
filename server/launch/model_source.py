"""Where `serve`'s model comes from: a folder on this machine, a hub id already in the local cache, or
one still to download (the default model: to fetch and convert). What is on this machine is checked
before anything starts, so a wrong path exits 2; a download happens after the daemon listens, so
`/health` and the start's progress say "downloading" (and "converting") while it lasts.
"""

from __future__ import annotations

from pathlib import Path

from kvfork.backends.model_path import ALLOW_PATTERNS, resolve_model
from kvfork.server.pool.specs import Fetch
from kvfork.server.watch.start_progress import StartProgress


def _cached(name: str) -> str | None:
    """The hub snapshot of `name` in the local cache, asking no network; None when it is not there."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, allow_patterns=ALLOW_PATTERNS, local_files_only=True)
    except Exception:  # not in the cache (the hub's many error types)
        return None


def model_source(name: str | None) -> tuple[str, Fetch | None]:
    """(the model's folder, None) when it is on this machine; (its name, how to fetch it) when not yet.
    FileNotFoundError or ValueError: it can be neither (no such folder, an offline hub, no config.json)."""
    if name is None:
        from kvfork.backends.default_model import default_model_dir, ensure_default_model, is_current

        folder = default_model_dir()
        if is_current(folder):
            return str(folder), None
        return str(folder), lambda progress: str(ensure_default_model(on_phase=progress.enter))
    local = Path(name).expanduser()
    if not local.exists() and name.count("/") == 1 and not name.startswith(("/", ".", "~")) and not _offline():
        cached = _cached(name)
        if cached is None:
            return name, lambda progress: _download(name, progress)
        local = Path(cached)
    folder = resolve_model(str(local) if local.exists() else name)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a model folder (it has no config.json)")
    return str(folder), None


def _download(name: str, progress: StartProgress) -> str:
    progress.enter("downloading", f"{name} from the Hugging Face hub")
    return str(resolve_model(name))


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
