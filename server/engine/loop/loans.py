"""Bytes of an engine's KV budget lent to something outside it while the engine does not need them: a pool's
model kept for its next load (server/pool/kept.py) lives in the KV budget of the model loaded in its place.

A loan counts in what Admission holds, so the budget's promise stands (the KV and what is lent never exceed
it), and it is the first thing to give way: before the prefix cache, any request or cache entry that needs
the bytes calls the loans back, oldest first, each loan's `call_back` dropping what it held."""

from __future__ import annotations

from typing import Callable, Hashable


class Loans:
    def __init__(self) -> None:
        self._loans: dict[Hashable, tuple[int, Callable[[], None]]] = {}  # in the order lent

    @property
    def nbytes(self) -> int:
        return sum(nbytes for nbytes, _ in self._loans.values())

    def lend(self, key: Hashable, nbytes: int, call_back: Callable[[], None]) -> Callable[[], None]:
        """Lend `nbytes` to `key`'s holder; `call_back()` drops what it holds when the engine needs them. Returns
        what the holder calls to give them back of its own accord (nothing is called back then)."""
        self._loans[key] = (nbytes, call_back)

        def end() -> None:
            self._loans.pop(key, None)

        return end

    def recall(self, need: int) -> int:
        """Call back the oldest loans until `need` bytes are back; the bytes returned."""
        back = 0
        while back < need and self._loans:
            key = next(iter(self._loans))
            nbytes, call_back = self._loans.pop(key)
            call_back()
            back += nbytes
        return back
