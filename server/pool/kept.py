"""What a model's unload keeps for its next load in this process: the model its backend built (the weights read
and converted to the device's layout) and its tokenizer, while its folder's files are as they were when it loaded.

Kept weights count in the pool's memory budget at their files' size, as a loaded model's do. Once the switch
that unloaded the model is over (`settle`), they are held where the budget has room beside the loaded models,
else in a loaded model's KV budget, lent by its engine while its requests and prefix cache leave those bytes
free (server/engine/loop/loans.py), else dropped. Either way they are the first thing to go: kept in the budget's
room, least recently kept first, when a load needs the bytes (pool.py's `_make_room`); lent, as soon as the
engine that lent them needs them, before its prefix cache gives way. So nothing is kept that a load or a
request needs, and the default budget (one model's footprint the whole of it) keeps a model's weights for its
return in the KV budget of the model loaded in its place."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from kvfork.server.engine.loop.admission import Admission
from kvfork.server.pool.budget import PoolBudget
from kvfork.server.text.tokenizer import PromptTokenizer

log = logging.getLogger("kvfork")


@dataclass(eq=False)
class Kept:
    """A closed model's built weights and tokenizer."""

    built: Any  # Backend.built()
    tokenizer: PromptTokenizer
    files: tuple = ()  # its folder's files when it loaded (loadable.folder_state)
    nbytes: int = 0  # what it takes of the memory budget: its weights
    since: float = 0.0  # when it was kept (monotonic)
    lender: tuple[str, Callable[[], None]] | None = None  # the loaded model whose KV budget holds it; ends the loan

    def drop(self) -> None:
        self.tokenizer.close()


class KeptModels:
    """What unloads kept, by model name."""

    def __init__(self, budget: PoolBudget):
        self.budget = budget
        self._kept: dict[str, Kept] = {}  # held in the budget's room or lent
        self._unplaced: dict[str, Kept] = {}  # left by unloads of a switch not over yet (`settle` places them)
        self._closed = False  # the daemon shuts down: nothing more is kept

    def names(self) -> set[str]:
        return set(self._kept) | set(self._unplaced)

    def lent(self) -> set[str]:
        return {name for name, k in self._kept.items() if k.lender is not None}

    def nbytes(self, but: str | None = None) -> int:
        """The budget's room kept weights take (but `but`'s: a model loading turns its own into loaded weights);
        lent ones are in a loaded model's footprint already."""
        return sum(k.nbytes for name, k in self._kept.items() if name != but and k.lender is None)

    def keep(self, name: str, kept: Kept | None, files: tuple | None, nbytes: int) -> None:
        """Hold what `name`'s unload left until the switch is over; a model not from a local folder (`files`
        None) keeps nothing. What `name`'s engine lent room to has lost it: it is placed again too."""
        for other, k in list(self._kept.items()):
            if k.lender is not None and k.lender[0] == name:
                k.lender = None
                self._unplaced[other] = self._kept.pop(other)
        if kept is None:
            return
        if files is None or self._closed:
            kept.drop()
            return
        kept.files, kept.nbytes, kept.since = files, nbytes, time.monotonic()
        self._unplaced[name] = kept

    def settle(self, loaded: dict[str, Admission | None], footprints: list[int]) -> None:
        """Place what unloads left, once their switch is over: in the budget's room beside the `footprints` of
        the loaded models, else lent by one of their engines (`loaded`: by model name), else in the room that
        older kept weights leave when they are dropped, else nowhere (dropped)."""
        for name, kept in sorted(self._unplaced.items(), key=lambda item: item[1].since):
            del self._unplaced[name]
            if self._closed:
                kept.drop()
            elif self.budget.holds(kept.nbytes, footprints, self.nbytes()):
                self._place(name, kept)
            elif lender := self._lend(name, kept.nbytes, loaded):
                self._place(name, kept, lender)
            elif self.budget.holds(kept.nbytes, footprints):
                while not self.budget.holds(kept.nbytes, footprints, self.nbytes()):
                    self.drop_oldest(name, f"for what model {name} kept")
                self._place(name, kept)
            else:
                kept.drop()
                log.info("dropped what model %s kept: no room in the budget", name)

    def _lend(self, name: str, nbytes: int,
              loaded: dict[str, Admission | None]) -> tuple[str, Callable[[], None]] | None:
        """The first loaded model whose engine lends `nbytes` for `name`'s kept weights, and the loan's end."""
        for lender, admission in loaded.items():
            end = admission.lend(name, nbytes, lambda: self._called(name)) if admission is not None else None
            if end is not None:
                return lender, end
        return None

    def _place(self, name: str, kept: Kept, lender: tuple[str, Callable[[], None]] | None = None) -> None:
        kept.lender, self._kept[name] = lender, kept
        where = self.budget.describe(kept.nbytes) if lender is None else \
            f"{kept.nbytes / 1024**3:.2f} GiB of model {lender[0]}'s KV budget, until it needs them"
        log.info("kept model %s's weights and tokenizer for its next load (%s)", name, where)

    def take(self, name: str, files: tuple | None) -> Kept | None:
        """What `name` kept, for its load now: None (and dropped) where its folder's files are not as they were."""
        kept = self._kept.pop(name, None) or self._unplaced.pop(name, None)
        if kept is not None and kept.lender is not None:
            kept.lender[1]()
            kept.lender = None
        if kept is not None and (files is None or files != kept.files):
            kept.drop()
            log.info("dropped what model %s kept: its folder changed", name)
            return None
        return kept

    def drop_oldest(self, but: str, why: str) -> None:
        """Drop the least recently kept in the budget's room (not `but`'s)."""
        name = min((n for n, k in self._kept.items() if n != but and k.lender is None),
                   key=lambda n: self._kept[n].since)
        self._kept.pop(name).drop()
        log.info("dropped what model %s kept %s", name, why)

    def _called(self, name: str) -> None:
        """The engine that lent `name`'s room needs it (after `close`, nothing is left to drop)."""
        kept = self._kept.pop(name, None)
        if kept is not None:
            kept.drop()
            log.info("dropped what model %s kept: the KV budget that held it is needed", name)

    def close(self) -> None:
        """Drop everything kept, and keep nothing more."""
        self._closed = True
        for kept in [*self._kept.values(), *self._unplaced.values()]:
            kept.drop()
        self._kept.clear()
        self._unplaced.clear()
