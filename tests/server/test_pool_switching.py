"""The pool's switching rule (server/pool/switching.py), as pure decisions over every small case: which waiting
request the next switch is for (A B A C runs as A A B C), which models make room (least recently used first,
idle ones first, never a pinned one nor the one loading) and which idle models --model-ttl unloads."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvfork.server.pool.switching import expired, next_switch, victims


@dataclass(eq=False)
class Model:
    name: str = "m"
    pinned: bool = False
    footprint: int = 1
    used: float = 0.0
    loaded: bool = False
    users: int = 0

    @property
    def ready(self) -> bool:
        return self.loaded


def budget(total: int):
    """A budget of `total` bytes (budget.PoolBudget.fits without --max-loaded-models)."""
    return lambda need, loaded: sum(loaded) + need <= total


def served_order(arrivals: str, room: int) -> tuple[str, int]:
    """Requests for the models named by `arrivals`' letters, all waiting at once, `room` models fitting: the
    order they are served in, as the pool runs them (a request for a ready model never waits; otherwise the
    next switch loads `next_switch`'s model after unloading `victims`), and how many loads that took."""
    models = {name: Model(name) for name in sorted(set(arrivals))}
    waiting, order, loads, clock = [models[name] for name in arrivals], [], 0, 0.0
    while waiting:
        clock += 1
        ready = [m for m in waiting if m.ready]
        if ready:
            for model in ready:
                model.used = clock
            order += [m.name for m in ready]
            waiting = [m for m in waiting if not m.ready]
            continue
        chosen = next_switch([(m, False) for m in waiting])
        assert chosen is not None
        target = waiting[chosen]
        loaded = [m for m in models.values() if m.loaded]
        for victim in victims(target, loaded, set(waiting), budget(room)):
            victim.loaded = False
        target.loaded, loads = True, loads + 1
    return "".join(order), loads


def test_a_b_a_c_runs_as_a_a_b_c():
    assert served_order("ABAC", room=1) == ("AABC", 3)


def test_every_arrival_order_runs_each_model_once_in_order_of_its_first_request():
    """Every order of up to six requests over three models, one or two fitting: each model's requests run
    together, models in the order their first request came, so each loads once."""
    for n in range(1, 7):
        for arrivals in itertools.product("ABC", repeat=n):
            text = "".join(arrivals)
            for room in (1, 2):
                order, loads = served_order(text, room)
                assert order == "".join(sorted(text, key=text.index)), (text, room)
                assert loads == len(set(text))


def test_the_next_switch_is_for_the_longest_waiting_request_that_needs_one_and_may():
    for n in range(4):
        for states in itertools.product([(False, False), (False, True), (True, False), (True, True)], repeat=n):
            waiting = [(Model(loaded=ready), held) for ready, held in states]
            expected = next((i for i, (ready, held) in enumerate(states) if not ready and not held), None)
            assert next_switch(waiting) == expected


def test_room_is_made_least_recently_used_first_idle_first_never_pinned_nor_the_model_loading():
    """Every world of three loaded models (each pinned or not, running requests or not, waited for or not, in
    every order of last use) and a budget of one to three of them."""
    kinds = list(itertools.product([False, True], repeat=3))  # pinned, users, wanted
    for chosen in itertools.product(kinds, repeat=3):
        for uses in itertools.permutations([1.0, 2.0, 3.0]):
            loaded = [Model(f"m{i}", pinned, 1, used, True, int(users))
                      for i, ((pinned, users, _), used) in enumerate(zip(chosen, uses))]
            wanted = {m for m, (_, _, want) in zip(loaded, chosen) if want}
            target = Model("new")
            for room in (1, 2, 3):
                going = victims(target, loaded, wanted, budget(room))
                may_go = [m for m in loaded if not m.pinned]
                idle = sorted((m for m in may_go if not m.users and m not in wanted), key=lambda m: m.used)
                busy = sorted((m for m in may_go if m not in idle), key=lambda m: m.used)
                assert going == (idle + busy)[:len(going)]
                left = len(loaded) - len(going)
                assert left + 1 <= room or set(going) == set(may_go)  # it fits, or all that may go goes
                assert len(going) == 0 or left + 1 + 1 > room  # and no more than it needs


def test_room_counts_bytes_and_never_unloads_the_model_it_makes_room_for():
    big = Model("big", footprint=6, used=2.0, loaded=True)
    small = Model("small", footprint=2, used=1.0, loaded=True)
    old = Model("old", footprint=1, used=0.5, loaded=True)  # the least recently used, and the one loading
    assert victims(Model(footprint=3), [big, small], set(), budget(10)) == [small]
    assert victims(Model(footprint=5), [big, small], set(), budget(10)) == [small, big]
    assert victims(Model(footprint=11), [big, small], set(), budget(10)) == [small, big]  # refused once all went
    assert victims(old, [old, big, small], set(), budget(8)) == [small]  # a reload: never itself
    assert victims(Model(footprint=2), [big, small], set(), budget(10)) == []


def test_a_model_idle_for_the_ttl_unloads_least_recently_used_first():
    for ready, pinned, users, wanted, age in itertools.product([False, True], [False, True], [0, 1], [False, True],
                                                               [4.0, 5.0, 6.0]):
        model = Model(pinned=pinned, loaded=ready, users=users, used=100.0 - age)
        due = expired([model], {model} if wanted else set(), 100.0, 5.0)
        assert due == ([model] if ready and not pinned and not users and not wanted and age >= 5.0 else [])
        assert expired([model], set(), 100.0, 0.0) == []  # --model-ttl 0: never
    older, newer = Model("a", used=1.0, loaded=True), Model("b", used=2.0, loaded=True)
    assert expired([newer, older], set(), 100.0, 5.0) == [older, newer]
