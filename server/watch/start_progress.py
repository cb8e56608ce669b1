"""Where a start is: the phase (`/health` names it while it lasts) and its display, a line redrawn in
place with the time spent on a terminal, a log line when a phase starts and every LOG_EVERY_S otherwise.

Phases, in order: downloading (a hub model not yet in the local cache), converting (the default
model's first run), loading (weights onto the device, the tokenizer), warming (--prefix-cache-warm),
then ready. A phase's length is not known ahead (no backend reports how much of its weights it has
read), so the display counts the seconds spent rather than drawing a fraction it would invent.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO

PHASES = ("downloading", "converting", "loading", "warming", "ready")
LOG_EVERY_S = 10.0
REDRAW_S = 0.25
SPINNER = "|/-\\"
OWN_OUTPUT = ("downloading", "converting")  # phases whose tools print their own progress


class StartProgress:
    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.phase = "loading"
        self.what = ""
        self.since = time.monotonic()
        self._ticker: asyncio.Task | None = None

    def enter(self, phase: str, what: str = "") -> None:
        assert phase in PHASES, phase
        self._end_line()
        self.phase, self.what, self.since = phase, what, time.monotonic()
        if phase == "ready":
            self.stop()
        elif not self._redrawn():
            self._write(f"kvfork: {self.line()}\n")

    def line(self, spin: str = "") -> str:
        spent = time.monotonic() - self.since
        return f"{spin}{self.phase} {self.what} ({spent:.0f} s)".replace("  ", " ")

    def start(self) -> None:
        """Redraw (a terminal) or repeat (a log) the current phase until `stop`; needs a running loop."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        self._end_line()

    async def _tick(self) -> None:
        beat = 0
        while True:
            await asyncio.sleep(REDRAW_S if self.tty else LOG_EVERY_S)
            beat += 1
            if self._redrawn():
                self._write(f"\r\x1b[2Kkvfork: {self.line(SPINNER[beat % len(SPINNER)] + ' ')}")
            elif not self.tty:
                self._write(f"kvfork: still {self.line()}\n")

    def _redrawn(self) -> bool:
        """Whether the phase is one line redrawn in place: on a terminal, except while pip's or the hub's own
        progress bars (downloading) and the converter's lines are shown."""
        return self.tty and self.phase not in OWN_OUTPUT

    def _end_line(self) -> None:
        if self._redrawn():
            self._write("\r\x1b[2K")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
