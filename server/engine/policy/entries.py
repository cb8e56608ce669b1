"""What the prefix cache's tiers hold (`Entry`) and what a lookup finds (`Match`, `Found`): plain values the
policies read (placement.py decides over a `Found`); cache/index.py stores, finds and removes them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Collection, Hashable, Literal

from kvfork.server.engine.policy.matching import Source

Tier = Literal["memory", "disk", "named", "running"]


@dataclass(eq=False)
class Entry:
    """A reusable state. `position`: tokens it has computed (a running request: prompt and output so far)."""

    tier: Tier
    scope: str  # api.Scope.digest
    tokens: tuple[int, ...]  # what it holds (a running request: its prompt only, never its output)
    owner: Hashable = None  # disk: the file name; named: (tenant, name); running: the request's rid
    sid: int | None = None  # memory, named: the runner's session holding the state
    nbytes: int = 0  # memory, named: the session's own bytes; disk: the file's
    reads: int = 0  # memory: bytes of its writer's store it reads by reference (freed with its last reader)
    kept: tuple[int, ...] = ()  # positions it holds a recurrent checkpoint at
    position: int = -1  # -1: len(tokens)
    stamp: int = 0  # recency: higher is more recent
    created: float = 0.0  # time.monotonic() when the index stored it
    uses: int = 0  # times it was used since (served a request, or the same prompt was captured again)

    def __post_init__(self) -> None:
        if self.position < 0:
            self.position = len(self.tokens)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        return self.scope, self.tokens


@dataclass(frozen=True)
class Match:
    entry: Entry
    upto: int  # clone [0, upto) of it


@dataclass
class Found:
    """What `best` found for one prompt, tier by tier."""

    scope: str  # the prompt's scope, as entries name it (Index.digest)
    memory: list[Match] = field(default_factory=list)  # best first: the runner tries them in order
    disk: Match | None = None
    donor: Source | None = None  # the running request with the best usable match, as matching.py sees it

    @property
    def cached(self) -> int:
        return self.memory[0].upto if self.memory else 0

    def without(self, gone: Collection[Entry]) -> Found:
        """This lookup once the `gone` entries left the index: the same walk would find the rest in this order."""
        left = {id(e) for e in gone}
        return replace(self, memory=[m for m in self.memory if id(m.entry) not in left])
