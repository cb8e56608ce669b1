"""An optimized BLAS for MLX on Linux.

The `mlx[cpu]` Linux wheel bundles a reference (netlib) BLAS. On a 2-core x86_64
machine it prefilled the default model about 30x slower than with Debian's
OpenBLAS preloaded. The preload must be in place before the process starts, so
the launcher re-executes itself with it when it serves on MLX (`reexec_for_backend`)
and the Makefile sets it for the test runner (`python -m kvfork.backends.mlx.blas` prints it).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
_REEXEC_MARK = "KVFORK_BLAS_CHECKED"


def find_openblas() -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    for path in _CANDIDATES + tuple(glob.glob("/usr/lib/*/openblas*/libopenblas*.so*")):
        if os.path.exists(path):
            return path
    return None


def install_openblas() -> None:
    """Install Debian's OpenBLAS where apt exists and we are root; never prompts."""
    if find_openblas() or not sys.platform.startswith("linux"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("kvfork: no OpenBLAS and cannot install it (needs root and apt); MLX will be slow on the CPU")
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")

    def apt_get(*args: str) -> int:
        return subprocess.call(["apt-get", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)

    if apt_get("install", "-y", "-q", "libopenblas0-pthread") != 0:
        apt_get("update", "-q")
        apt_get("install", "-y", "-q", "libopenblas0-pthread")
    if not find_openblas():
        print("kvfork: installing libopenblas0-pthread failed; MLX will be slow on the CPU")


def thread_env() -> dict[str, str]:
    """Cap BLAS threads at the machine's cores, so two backends in one process do not fight."""
    cores = str(os.cpu_count() or 1)
    return {"OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", cores)}


def reexec_for_backend(mlx: bool) -> None:
    """Restart this process once: with OpenBLAS preloaded for MLX, without an inherited one for torch.

    A preloaded OpenBLAS also takes over torch's own (MKL) BLAS calls: on a 2-core
    machine it made torch's prefill 3-5x and decode about 3x slower (docs/benchmarks.md).
    Warns once when MLX is to run and no optimized BLAS can be had.
    """
    if os.environ.get(_REEXEC_MARK) or not sys.platform.startswith("linux"):
        return
    inherited = os.environ.get("LD_PRELOAD", "")
    preload = [p for p in inherited.split(":") if p and "libopenblas" not in os.path.basename(p)]
    path = find_openblas() if mlx else None
    if mlx and path is None:
        print("kvfork: no optimized BLAS found (install libopenblas0-pthread); MLX on the CPU will be slow", file=sys.stderr)
    env = dict(os.environ, **thread_env(), **{_REEXEC_MARK: "1"})
    wanted = ":".join(([path] if path else []) + preload)
    if wanted == inherited:
        os.environ.update(env)
        return
    env["LD_PRELOAD"] = wanted
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


if __name__ == "__main__":
    if "--install" in sys.argv:
        install_openblas()
    else:
        print(find_openblas() or "")
