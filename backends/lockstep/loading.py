"""Loading one model on every rank, in step: each rank loads its shard, and no rank goes on before
every rank has loaded (or every rank knows one could not).

Two checks, each one collective every rank joins: that every rank has the model folder (before any
loading starts: mlx-lm's sharded loading runs collectives of its own, which a rank that failed
early would leave unmatched), and that every rank's load succeeded. Neither is watched by rank 0's
step watchdog: reading the weights takes as long as it takes, on every rank alike.
"""

from __future__ import annotations

from kvfork.backends.base import Backend, ModelInfo
from kvfork.backends.lockstep.channel import Channel
from kvfork.backends.model_path import resolve_model


def load_in_step(backend: Backend, channel: Channel, folder: str, dtype: str | None) -> ModelInfo:
    """`backend.load(folder, dtype)` on this rank, once every rank has the folder; raises on every rank
    when any rank's load failed (this rank's own error, else the other rank's failure)."""
    try:
        found = (resolve_model(folder) / "config.json").is_file()
    except (FileNotFoundError, OSError, ValueError):
        found = False
    if not channel.all_ok(found):
        raise FileNotFoundError(f"the model folder {folder} is missing on {'this rank' if not found else 'a rank'}"
                                " (every rank loads it from its own disk, at the same path)")
    error: Exception | None = None
    try:
        info = backend.load(folder, dtype)
    except Exception as exc:
        error = exc
    if not channel.all_ok(error is None):
        raise error or RuntimeError("loading the model failed on another rank (its log says why)")
    return info
