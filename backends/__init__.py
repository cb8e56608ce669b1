"""Backends by name. Each module is imported only when asked for, so a machine
without one framework still runs the other."""

from __future__ import annotations

import importlib
import platform
import sys

from kvfork.backends.base import Backend

BACKENDS = {
    "mlx": "kvfork.backends.mlx.backend:MLXBackend",
    "torch": "kvfork.backends.torch.backend:TorchBackend",
}


def default_backend() -> str:
    """MLX on Apple Silicon, torch everywhere else (CUDA when present, else the CPU)."""
    return "mlx" if sys.platform == "darwin" and platform.machine() == "arm64" else "torch"


def prepare_process(name: str) -> None:
    """Before anything loads: make this process the one backend `name` ("auto" too) runs best in.

    MLX's Linux wheel computes on a reference BLAS and wants Debian's OpenBLAS preloaded; a
    preloaded OpenBLAS slows torch's own BLAS 3-5x (docs/benchmarks.md). A preload must be in
    place when the process starts, so this re-executes it once, with or without one (mlx/blas.py).
    """
    from kvfork.backends.mlx.blas import reexec_for_backend  # plain Python: no MLX import

    reexec_for_backend(mlx=(default_backend() if name == "auto" else name) == "mlx")


def create_backend(name: str) -> Backend:
    if name == "auto":
        name = default_backend()
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
