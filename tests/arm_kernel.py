"""kv_reading.c built for 64-bit Arm (its Advanced SIMD path) and run under qemu's user-mode emulator, where a cross
compiler (`aarch64-linux-gnu-gcc`) and `qemu-aarch64` are installed (Debian's gcc-aarch64-linux-gnu and qemu-user,
installed by the test set-up where it runs as root, as CI does):
`library(folder)` stands where `kv_reading.Library` does, so torch's `Kernel` and its tests read rows through
the Arm build. Each call sends the spans its pointers cover to fixtures/kv_reading_driver.c and copies the
output's span back."""

from __future__ import annotations

import ctypes
import struct
import subprocess
from pathlib import Path

from debian_packages import installed
from kvfork.backends import kv_reading

CC, EMULATOR = "aarch64-linux-gnu-gcc", "qemu-aarch64"
PACKAGES = ("gcc-aarch64-linux-gnu", "qemu-user")
MISSING = f"no {CC} or {EMULATOR} (apt-get install {' '.join(PACKAGES)})"
DRIVER = Path(__file__).parent / "fixtures" / "kv_reading_driver.c"
FLAGS = ("-O3", "-march=armv8-a", "-fopenmp", "-static")  # the baseline every 64-bit Arm CPU runs


def _floats(head: int, row: int, heads: int, rows: int, last: int) -> int:
    return 4 * ((heads - 1) * head + (rows - 1) * row + last)


def _rows(head_bytes: int, row_bytes: int, heads: int, t: int, dim: int, bits: int, group: int) -> int:
    return (heads - 1) * head_bytes + (t - 1) * row_bytes + dim * bits // 8 + 4 * (dim // group)


class EmulatedLibrary:
    """kv_reading.Library's calls, each run by the Arm build under the emulator."""

    threaded = True

    def __init__(self, program: Path):
        self.program = program

    def _run(self, which: int, args: list[int | None], spans: dict[int, int], outputs: tuple[int, ...]) -> None:
        sent = [spans.get(i, a) for i, a in enumerate(args)]
        data = struct.pack(f"<{1 + len(args)}q", which, *sent)
        data += b"".join(ctypes.string_at(args[i], spans[i]) for i in sorted(spans) if spans[i])
        got = subprocess.run([EMULATOR, str(self.program)], input=data, capture_output=True, check=True,
                             timeout=120).stdout
        assert len(got) == sum(spans[out] for out in outputs)
        for out in outputs:
            ctypes.memmove(args[out], got[:spans[out]], spans[out])
            got = got[spans[out]:]

    def scores(self, *args: int) -> None:
        q, q_head, q_row, heads, n, dim, _, head_bytes, row_bytes, t, bits, group = args[:12]
        spans = {0: _floats(q_head, q_row, heads, n, dim),
                 6: _rows(head_bytes, row_bytes, heads, t, dim, bits, group),
                 14: _floats(args[15], args[16], heads, n, t)}
        self._run(0, list(args), spans, (14,))

    def block_sums(self, *args: int | None) -> None:
        _, w_head, w_row, heads, n, dim, _, head_bytes, row_bytes, t, bits, group, _, _, block = args[:15]
        blocks = -(-t // block)
        spans = {0: _floats(w_head, w_row, heads, n, t),
                 6: _rows(head_bytes, row_bytes, heads, t, dim, bits, group),
                 15: 4 * heads * blocks * n * dim, 16: 4 * heads * blocks * n if args[16] else 0}
        self._run(1, list(args), spans, (15, 16))

    def decode(self, *args: int) -> None:
        _, head_bytes, row_bytes, heads, t, dim, bits, group = args[:8]
        spans = {0: _rows(head_bytes, row_bytes, heads, t, dim, bits, group),
                 10: _floats(args[11], args[12], heads, t, dim)}
        self._run(2, list(args), spans, (10,))


def library(folder: Path) -> EmulatedLibrary | None:
    """The Arm build with its driver, or None where the cross compiler or the emulator is missing (and cannot be
    installed)."""
    if not installed([CC, EMULATOR], PACKAGES):
        return None
    program = folder / "kv_reading_arm"
    subprocess.run([CC, *FLAGS, "-o", str(program), str(kv_reading.SOURCE), str(DRIVER)], check=True,
                   capture_output=True, timeout=kv_reading.BUILD_SECONDS)
    return EmulatedLibrary(program)
