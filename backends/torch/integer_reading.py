"""The CPU's reading of int8 and int4 KV rows, by kv_reading.c: a decode row's scores and each block's weighted
values computed from the stored integers, scales and biases in one pass over the rows, and a prefill chunk's
rows decoded to floats.

torch's own products need the integers cast to floats first, a copy four times the rows' bytes that the products
then read again; on an AMD EPYC with AVX-512 (2 threads, 3 key heads of 64, 2,048 keys) that reading took 280 us
against float32's 100 us in SDPA, and the kernel 100 us (docs/kv-budget.md, "Speed"). No library ships such a
kernel for torch on the CPU (torch's `_weight_int8pack_mm` took 7x its float product here), so kvfork compiles
its own: once per source and CPU, with the system's C compiler (`cc`), for the CPU it runs on, into
$KVFORK_HOME/kernels. It is built for x86-64 with AVX2 or AVX-512 alone (`#error` elsewhere; an unvectorized
build measured slower than torch's products). Where it cannot be built (no compiler, another CPU) the storage reads
the rows through torch's products, the same values within float32 rounding (kv_storage.py, `Grouped`).

Its loops run on OpenMP: the build links `libgomp.so.1`, which torch's wheel has already loaded under that
name, so the kernel's threads are torch's own pool (checked at load: a second OpenMP runtime mapped into the
process would spin beside torch's, so the kernel then runs on one thread).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvfork.backends.device_memory import cpu_flags
from kvfork.backends.home import kvfork_home

log = logging.getLogger("kvfork.torch")

SOURCE = Path(__file__).with_name("kv_reading.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MOST_DIMS = 256  # kv_reading.c's MOST_DIMS
BUILD_SECONDS = 120
OPENMP_RUNTIMES = re.compile(r"lib(gomp|omp|iomp5)[-.\w]*\.so")

_I, _P, _C = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process, by file (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps.splitlines() if OPENMP_RUNTIMES.search(line.rsplit("/", 1)[-1])}


def cpu_identity() -> str:
    """What a build for `-march=native` depends on: the machine and, on Linux, the CPU's instruction sets."""
    return " ".join([platform.machine(), *sorted(cpu_flags())])


def build(cc: str, folder: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """kv_reading.c compiled for this CPU in `folder`, named by the digest of the source, the flags, the
    compiler and the CPU (a build already there is used as it is, and a new one replaces the folder's others:
    earlier sources' or CPUs'); raises where the compiler fails."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), cc.encode(),
                                        cpu_identity().encode()])).hexdigest()[:24]
    built = folder / f"kv_reading-{digest}.so"
    if built.exists():
        return built
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        out = Path(work) / built.name
        subprocess.run([cc, *flags, "-o", str(out), str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=BUILD_SECONDS)
        os.replace(out, built)  # atomic: another process building the same file meanwhile is harmless
    for other in folder.glob("kv_reading-*.so"):
        if other != built:
            other.unlink(missing_ok=True)  # a process that has it loaded keeps its mapping
    return built


class Kernel:
    """kv_reading.c loaded: `scores`, `block_sums` and `decode` over CPU tensors whose last dim is contiguous
    (stored rows: uint8; queries, weights and decoded rows: float32)."""

    def __init__(self, library: ctypes.CDLL, threaded: bool):
        self.threaded = threaded
        self._scores, self._block_sums, self._decode = library.kv_scores, library.kv_block_sums, library.kv_decode
        self._scores.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _C, _I, _P, _I, _I, _C]
        self._block_sums.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _C, _I, _I, _P, _C]
        self._decode.argtypes = [_P, _I, _I, _I, _I, _I, _C, _I, _P, _I, _I, _C]
        self._scores.restype = self._block_sums.restype = self._decode.restype = None

    def threads(self) -> int:
        return torch.get_num_threads() if self.threaded else 1

    def scores(self, q: torch.Tensor, stored: torch.Tensor, bits: int, group: int) -> torch.Tensor:
        """q [kv_heads, n, head_dim] (float32) against stored keys [kv_heads, t, width]: [kv_heads, n, t]."""
        q = q if q.stride(-1) == 1 else q.contiguous()
        heads, n, dim = q.shape
        t = stored.shape[1]
        out = q.new_empty(heads, n, t)
        self._scores(q.data_ptr(), q.stride(0), q.stride(1), heads, n, dim, stored.data_ptr(), stored.stride(0),
                     stored.stride(1), t, bits, group, out.data_ptr(), out.stride(0), out.stride(1), self.threads())
        return out

    def block_sums(self, w: torch.Tensor, stored: torch.Tensor, bits: int, group: int, dim: int,
                   block: int) -> torch.Tensor:
        """Weights w [kv_heads, n, t] (float32) of stored values [kv_heads, t, width], summed per `block` keys:
        [kv_heads, blocks, n, dim]."""
        w = w if w.stride(-1) == 1 else w.contiguous()
        heads, n, t = w.shape
        out = w.new_empty(heads, -(-t // block), n, dim)
        self._block_sums(w.data_ptr(), w.stride(0), w.stride(1), heads, n, dim, stored.data_ptr(), stored.stride(0),
                         stored.stride(1), t, bits, group, block, out.data_ptr(), self.threads())
        return out

    def decode(self, stored: torch.Tensor, out: torch.Tensor, bits: int, group: int) -> None:
        """Stored rows [kv_heads, t, width] decoded into `out` [kv_heads, t, head_dim] (float32, its last dim
        contiguous)."""
        heads, t, dim = out.shape
        self._decode(stored.data_ptr(), stored.stride(0), stored.stride(1), heads, t, dim, bits, group,
                     out.data_ptr(), out.stride(0), out.stride(1), self.threads())


@functools.cache
def kernel() -> Kernel | None:
    """kv_reading.c built and loaded, or None where it cannot be (said once in the log)."""
    cc = shutil.which("cc")
    if cc is None:
        log.warning("int8/int4 KV on the CPU: no C compiler (cc), so torch's products read the rows, slower")
        return None
    before = openmp_runtimes()
    try:
        library = ctypes.CDLL(str(build(cc, kvfork_home() / "kernels")))
    except (OSError, subprocess.SubprocessError) as exc:
        said = str(getattr(exc, "stderr", None) or exc).strip()
        log.warning("int8/int4 KV on the CPU: kv_reading.c was not built for this CPU, so torch's products read "
                    "the rows, slower: %s", said.splitlines()[-1] if said else repr(exc))
        return None
    threaded = not (before and openmp_runtimes() - before)
    if not threaded:
        log.warning("int8/int4 KV on the CPU: the kernel's OpenMP runtime is not torch's, so it runs on one thread")
    return Kernel(library, threaded)
