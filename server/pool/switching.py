"""The pool's switching rule, as pure decisions over what the pool holds now (pool.py applies them).

- `next_switch`: a switch is for the longest waiting request whose model is not ready and whose tenant may
  switch now (turns.py). A request for a ready model never waits behind a switch, so requests for A B A C,
  one model fitting at a time, run as A A B C.
- `victims`: making room unloads the least recently used unpinned model, idle ones (no request holds it or
  waits for it) first, until the model to load fits the budget; never a pinned model, nor the one loading.
- `expired`: a model idle for --model-ttl seconds unloads, the least recently used first; never a pinned
  one, one running requests, or one a request waits for.
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Protocol, Sequence, TypeVar


class Switchable(Protocol):
    """A model of the pool as the rule reads it (pool.PooledModel)."""

    pinned: bool
    footprint: int  # bytes of the pool's budget it takes once loaded
    used: float  # when a request last took it (monotonic)

    @property
    def ready(self) -> bool: ...  # loaded and taking requests

    @property
    def users(self) -> int: ...  # requests holding it


M = TypeVar("M", bound=Switchable)
Fits = Callable[[int, list[int]], bool]  # the budget's rule: a footprint beside the loaded ones' (budget.py)


def next_switch(waiting: Sequence[tuple[M, bool]]) -> int | None:
    """Which of `waiting` (each request's model and whether its tenant is held back now, in arrival order)
    the next switch is for; None: none needs one now."""
    return next((i for i, (model, held) in enumerate(waiting) if not model.ready and not held), None)


def victims(target: M, loaded: Sequence[M], wanted: Collection[M], fits: Fits) -> list[M]:
    """The models to unload, in order, so `target` fits beside the rest of `loaded`; `wanted`: the models
    requests wait for. Fewer than that when no more may go (then `target` does not fit: refused)."""
    rest, out = list(loaded), []
    while not fits(target.footprint, [m.footprint for m in rest]):
        may_go = [m for m in rest if not m.pinned and m is not target]
        idle = [m for m in may_go if m.users == 0 and m not in wanted]
        victim = min(idle or may_go, key=lambda m: m.used, default=None)
        if victim is None:
            break
        out.append(victim)
        rest.remove(victim)
    return out


def expired(models: Iterable[M], wanted: Collection[M], now: float, ttl: float) -> list[M]:
    """The models idle for `ttl` seconds at `now` (0: never), least recently used first."""
    if ttl <= 0:
        return []
    idle = [m for m in models if m.ready and not m.pinned and not m.users and m not in wanted
            and now - m.used >= ttl]
    return sorted(idle, key=lambda m: m.used)
