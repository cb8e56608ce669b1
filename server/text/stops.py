"""Stop strings over streamed text: never stream part of one.

Text that could be the start of a stop string is held back until more text
rules it in (the request stops there, the stop string is dropped) or out (the
text is released). Matching runs over held text plus the new piece, so a stop
string split across any number of tokens is still found.

It runs on the event loop for every token, so its cost is bounded by the limits
on stop strings (server/guard/limits.py: how many, how long) and kept small: one
`str.find` per stop string over fewer than their longest length plus the piece,
and the held-back tail found by bisecting the sorted stop strings, not by
trying each one (about 0.1 ms a token at 256 stop strings of 256 characters).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass
class StopMatch:
    text: str  # the text safe to release now
    stopped: bool  # a stop string was found; `text` ends right before it


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.sorted = sorted(set(self.stops))
        self.longest = max(map(len, self.stops), default=0)
        self.held = ""
        self.matched: str | None = None  # the stop string that ended the text (Anthropic reports it)

    def feed(self, piece: str) -> StopMatch:
        if not self.stops:
            return StopMatch(piece, False)
        text = self.held + piece
        found = [(at, stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if found:
            first, self.matched = min(found, key=lambda f: f[0])
            self.held = ""
            return StopMatch(text[:first], True)
        keep = self._partial_suffix(text)
        self.held = text[len(text) - keep :] if keep else ""
        return StopMatch(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The request ended without a stop string: the held text was ordinary text."""
        text, self.held = self.held, ""
        return text

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that begins some stop string: a tail begins one exactly
        when the first stop string sorted at or after it does."""
        stops = self.sorted
        for keep in range(min(len(text), self.longest - 1), 0, -1):
            tail = text[-keep:]
            at = bisect.bisect_left(stops, tail)
            if at < len(stops) and stops[at].startswith(tail):
                return keep
        return 0
