"""kv_reading.c, the CPU's reading of int8 and int4 KV rows where they are stored: built, loaded and given
argument types here, for both backends (torch's `integer_reading.py` and MLX's `cpu_attention.py` hand it their
arrays' pointers and strides).

Array libraries read such rows only after casting their integers to floats: a copy four times the rows' bytes
that their products then read again. The kernel computes a decode row's scores and each block's weighted values
from the integers, scales and biases in one pass over the rows, and decodes a prefill chunk's rows to floats (on
an AMD EPYC with AVX-512, 2 threads, 3 key heads of 64, 2,048 keys: 85-120 us a layer against float32 SDPA's
105-110 us, and torch's products' 280 us; docs/kv-budget.md, "Speed"). No library ships such a kernel for the CPU (torch's
`_weight_int8pack_mm` took 7x its float product here, MLX's CPU `quantized_matmul` 8x), so kvfork compiles its
own: once per source and CPU, with the system's C compiler (`cc`), for the CPU it runs on, into
$KVFORK_HOME/kernels. It is written for x86-64 with AVX2 or AVX-512 and for 64-bit Arm's Advanced SIMD (NEON)
alone (`#error` elsewhere: an unvectorized build measured slower than torch's products; the Arm build is checked
under an emulator, its speed not measured). Where it cannot be built (no compiler, another CPU) the backends read
the rows through their own array operations, the same values within float32 rounding.

Its loops run on OpenMP (`libgomp.so.1`), on as many threads as the caller asks. torch's wheel has already
loaded that runtime under that name, so under torch the kernel's threads are torch's own pool. A second OpenMP
runtime mapped beside one already loaded would spin beside it, so the kernel then runs on one thread
(`Library.threaded`).
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

from kvfork.backends.device_memory import cpu_flags
from kvfork.backends.home import kvfork_home

log = logging.getLogger("kvfork.backends")

SOURCE = Path(__file__).with_name("kv_reading.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
MOST_DIMS = 256  # kv_reading.c's MOST_DIMS
MOST_TREE = 4096  # kv_reading.c's MOST_TREE: the longest block whose sum of weights it adds
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


class Library:
    """kv_reading.c loaded: `scores`, `block_sums` and `decode` take pointers, element strides (floats) and byte
    strides (stored rows) as kv_reading.c says; `threaded` is False where its OpenMP runtime is a second one."""

    def __init__(self, library: ctypes.CDLL, threaded: bool):
        self.threaded = threaded
        self.scores, self.block_sums, self.decode = library.kv_scores, library.kv_block_sums, library.kv_decode
        self.scores.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _C, _I, _I, _I, _P, _I, _I, _C]
        self.block_sums.argtypes = [_P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _C, _I, _I, _I, _I, _P, _P, _C]
        self.decode.argtypes = [_P, _I, _I, _I, _I, _I, _C, _I, _I, _I, _P, _I, _I, _C]
        self.scores.restype = self.block_sums.restype = self.decode.restype = None


def loaded(path: Path) -> Library:
    """The built kernel at `path`, loaded."""
    before = openmp_runtimes()
    library = ctypes.CDLL(str(path))
    return Library(library, threaded=not (before and openmp_runtimes() - before))


@functools.cache
def library() -> Library | None:
    """kv_reading.c built and loaded, or None where it cannot be (said once in the log)."""
    cc = shutil.which("cc")
    if cc is None:
        log.warning("int8/int4 KV on the CPU: no C compiler (cc), so the backend's array operations read the "
                    "rows, slower")
        return None
    try:
        built = loaded(build(cc, kvfork_home() / "kernels"))
    except (OSError, subprocess.SubprocessError) as exc:
        said = str(getattr(exc, "stderr", None) or exc).strip()
        log.warning("int8/int4 KV on the CPU: kv_reading.c was not built for this CPU, so the backend's array "
                    "operations read the rows, slower: %s", said.splitlines()[-1] if said else repr(exc))
        return None
    if not built.threaded:
        log.warning("int8/int4 KV on the CPU: the kernel's OpenMP runtime is a second one beside the process's "
                    "own, so it runs on one thread")
    return built
