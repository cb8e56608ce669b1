"""Feeding scripted text to a parser in every way it can arrive."""

from __future__ import annotations

import itertools
from typing import Callable

from kvfork.server.generate.chat_output import ChatOutput, collect
from kvfork.server.toolcalls.base import Event


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(make_parser: Callable[[], object], pieces: list[str]) -> list[Event]:
    parser = make_parser()
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)  # type: ignore[attr-defined]
    return events + parser.finish()  # type: ignore[attr-defined]


def splits(text: str) -> list[list[str]]:
    """Every two-piece split, every three-piece split around a moving middle, and one char at a time."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    out += [[text[:i], text[i : i + 3], text[i + 3 :]] for i in range(1, len(text) - 3)]
    return out


def parse_every_way(make_parser: Callable[[], object], text: str) -> ChatOutput:
    """The reply parsed whole; asserts every streamed split gives the same reply."""
    whole = collect(run(make_parser, [text]))
    for pieces in splits(text):
        assert collect(run(make_parser, pieces)) == whole, pieces
    return whole
