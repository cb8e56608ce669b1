"""What a device reports about its memory, read where the backend runs (server/engine/policy/memory_plan.py
turns it into the KV budget), and the CPU's instruction sets (`cpu_flags`).

Apple Silicon: the GPU shares the machine's memory, and Metal recommends a working set
(`max_recommended_working_set_size`, about 3/4 of it); kvfork raises MLX's wired limit to that
size at load, as mlx-lm's server does, so the weights and KV stay resident rather than being paged.
CUDA: the device's own memory (host RAM never counts). CPU: the machine's physical memory.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DeviceMemory:
    kind: str  # "metal", "cuda" or "cpu"
    name: str  # the device's name, for the start line
    total_bytes: int  # the device's memory: unified memory on Apple Silicon, physical memory on a CPU
    host_bytes: int  # the machine's physical memory
    working_set_bytes: int = 0  # Metal's recommended working set (0 where there is none)
    weights_bytes: int = 0  # the loaded weights
    activation_bytes: int = 0  # measured peak of one full step beyond the weights and its KV (0: not measured)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def give_back_free_heap() -> None:
    """Return the pages malloc's heap holds free to the system (glibc's malloc_trim). A pass's buffers of many
    sizes (MLX's arrays on the CPU, torch's tensors) are freed between live ones, and glibc keeps such pages
    resident: an MLX daemon on the CPU held 340-800 MiB so after its sessions were released, all of it given
    back by one trim (docs/kv-budget.md, "What the budget counts"). Some milliseconds where there is much to
    give back, a tenth of one where there is none."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def cpu_flags() -> set[str]:
    """The instruction-set flags the CPU reports (Linux: x86's `flags`, Arm's `Features`), else none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    listed = (line.split(":", 1)[1] for line in text.splitlines() if line.startswith(("flags", "Features")))
    return set(next(listed, "").split())


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_memory(weights_bytes: int = 0) -> DeviceMemory:
    host = host_memory_bytes()
    return DeviceMemory("cpu", f"CPU ({os.cpu_count()} cores)", host, host, weights_bytes=weights_bytes)


def metal_memory(weights_bytes: int) -> DeviceMemory:
    """Apple Silicon's reading, with MLX's wired limit raised to Metal's recommended working set."""
    import mlx.core as mx
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    maybe_set_recommended_wired_limit()
    info = mx.device_info()
    working_set = int(info["max_recommended_working_set_size"])
    return DeviceMemory("metal", str(info.get("device_name", "Apple GPU")), int(info["memory_size"]),
                        host_memory_bytes(), working_set, weights_bytes)


def cuda_memory(device, weights_bytes: int, activation_bytes: int) -> DeviceMemory:
    import torch

    props = torch.cuda.get_device_properties(device)
    return DeviceMemory("cuda", props.name, int(props.total_memory), host_memory_bytes(),
                        weights_bytes=weights_bytes, activation_bytes=activation_bytes)


def weights_on_disk(folder: str | Path) -> int:
    """Bytes of a model folder's weight files: what loading it will take, before it is loaded."""
    return sum(p.stat().st_size for p in Path(folder).glob("*") if p.suffix in (".safetensors", ".gguf", ".bin"))
