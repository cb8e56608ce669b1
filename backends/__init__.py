"""Backends by name. Each module is imported only when asked for, so a machine
without one framework still runs the other."""

from __future__ import annotations

import importlib
import platform
import sys

from backends.base import Backend

BACKENDS = {
    "mlx": "backends.mlx.backend:MLXBackend",
    "torch": "backends.torch.backend:TorchBackend",
}


def default_backend() -> str:
    """MLX on Apple Silicon, torch everywhere else (CUDA when present, else the CPU)."""
    return "mlx" if sys.platform == "darwin" and platform.machine() == "arm64" else "torch"


def create_backend(name: str) -> Backend:
    if name == "auto":
        name = default_backend()
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
