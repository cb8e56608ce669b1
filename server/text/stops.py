"""Stop strings over streamed text: never stream part of one.

Text that could be the start of a stop string is held back until more text
rules it in (the request stops there, the stop string is dropped) or out (the
text is released). Matching runs over held text plus the new piece, so a stop
string split across any number of tokens is still found.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopMatch:
    text: str  # the text safe to release now
    stopped: bool  # a stop string was found; `text` ends right before it


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, piece: str) -> StopMatch:
        if not self.stops:
            return StopMatch(piece, False)
        text = self.held + piece
        first = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
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
        """Length of the longest end of `text` that begins some stop string."""
        for keep in range(min(len(text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = text[-keep:]
            if any(s.startswith(tail) for s in self.stops):
                return keep
        return 0
