"""Where a request starts: one pure decision over a read-only view.

    place(request, view) -> Placement

The engine takes the view (loop/placing.py's `take_view`, over its requests and the index) and
applies what comes back (serving.Serving._apply). `place` reads of the request only what `Placed`
names. The placements:
- Resume(sid, upto): a session it holds already: its named session's (warm resume),
  or a clone that landed for it while it waited (a follow, a disk read);
- CloneRunning(donor, upto): a clone of what a running request has committed now (clone-now);
- Cached(matches): a clone of the first prefix cache entry the backend agrees to, else
  an empty session;
- Follow(leader, target): park, holding no slot, until the leader has committed `target`;
- Restore(match): park, holding no slot, until the disk tier's file is read and loaded;
- Fresh(): an empty session: prefill it all;
- Wait(): no slot yet and nothing to follow: it stays queued.

`place_without_reuse` is where a request starts when the lookup or the choice raised:
reuse is optional work, so it prefills (the engine logs and counts the failure).

Rules (the policies cited hold the details):
- a named session resumes its own state or starts cold, and takes no other reuse;
- with active reuse off (--active-prefix-reuse-min-tokens 0), the prefix cache serves it;
- otherwise follow.decide decides between following and matching.choose_reuse's
  clone-now choice (donor, cache, or nothing);
- the disk tier comes last: a file that serves more than the best match in memory is
  restored when the cost model (restore.choose_restore) expects it to beat computing;
- a request without a slot may only park behind a leader: everything else waits for
  its slot, when the view is taken again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Protocol, Sequence

from kvfork.server.engine.policy.entries import Entry, Found, Match
from kvfork.server.engine.policy.follow import FollowDecision, FollowPolicy, Leader, decide
from kvfork.server.engine.policy.matching import Recipient, choose_reuse
from kvfork.server.engine.policy.rates import Rates
from kvfork.server.engine.policy.restore import choose_restore


class Landing(Protocol):
    """A session a waiting request holds already (loop/request.py's `Landed`)."""

    @property
    def sid(self) -> int: ...
    @property
    def upto(self) -> int: ...


class Resumable(Protocol):
    """A request's named session (cache/sessions.py's `NamedSession`)."""

    @property
    def state(self) -> Entry | None: ...  # what it keeps (tier "named"), if anything
    def resumes(self, prompt: Sequence[int], scope: str) -> bool: ...


class Placed(Protocol):
    """What `place` reads of a request (loop/request.py's `Request` is one)."""

    @property
    def rid(self) -> int: ...
    @property
    def prompt(self) -> list[int]: ...
    @property
    def decision(self) -> dict[str, Any]: ...  # the log fields decided so far (a refused clone, an expired follow)
    @property
    def named(self) -> Resumable | None: ...
    @property
    def landed(self) -> Landing | None: ...  # a clone that landed for it while it waited


@dataclass(frozen=True)
class View:
    """What `place` may read: a snapshot, never the engine itself."""

    found: Found  # Index.best for its prompt
    leaders: Sequence[Leader]  # whom it may follow (follow.leader_views)
    rates: Rates
    prefilling: int  # requests prefilling now, the recipient not counted
    policy: FollowPolicy  # active reuse's threshold; following on or off for it, and its wait left
    min_cached: int  # --prefix-cache-min-tokens: the shortest cached match used, on disk too
    restore: bool  # the disk tier may serve it
    slot: bool  # it holds an inference slot; else it waits for one
    names: Mapping[Hashable, str] = field(default_factory=dict)  # request ids by rid, for the log line


@dataclass(frozen=True)
class _Placed:
    log: dict[str, Any] | None = field(default=None, kw_only=True)  # the decision and its inputs (None: as was)
    follow_choice: str | None = field(default=None, kw_only=True)  # follow.decide's reason, when it ran
    disk_choice: str | None = field(default=None, kw_only=True)  # the cost model's, when it ran
    cached: int = field(default=0, kw_only=True)  # the best prefix cache match


@dataclass(frozen=True)
class Resume(_Placed):
    sid: int
    upto: int
    named: bool  # its named session's state (else a landed clone)


@dataclass(frozen=True)
class CloneRunning(_Placed):
    donor: int
    upto: int


@dataclass(frozen=True)
class Cached(_Placed):
    matches: tuple[Match, ...]


@dataclass(frozen=True)
class Follow(_Placed):
    leader: int
    target: int
    decided: FollowDecision  # the follow order is made of it (follow.FollowOrder.park)


@dataclass(frozen=True)
class Restore(_Placed):
    match: Match


@dataclass(frozen=True)
class Fresh(_Placed):
    pass


@dataclass(frozen=True)
class Wait(_Placed):
    pass


Placement = Resume | CloneRunning | Cached | Follow | Restore | Fresh | Wait


def place(r: Placed, view: View) -> Placement:
    if (resumed := _landed(r)) is not None:
        return resumed
    if r.named is not None:
        state = r.named.state
        if state is not None and r.named.resumes(r.prompt, view.found.scope):
            return Resume(state.sid, len(state.tokens), named=True)  # type: ignore[arg-type]
        return Fresh()
    found = view.found
    if view.policy.min_tokens <= 0:  # active reuse off: the prefix cache, or the disk tier
        why: dict[str, Any] = dict(log=dict(r.decision), cached=found.cached)
        return _restore(view, found.cached, why) or _cached(found, **why)
    decided = _follow_decision(r, view)
    log = {**decided.log_fields(), **{k: r.decision[k] for k in ("clone_refused", "follow_expired")
                                      if k in r.decision}}
    for key in ("donor", "leader"):  # name them as the client did
        log[key] = view.names.get(log[key])
    why = dict(log=log, follow_choice=decided.reason, cached=found.cached)
    if not view.slot:
        return Follow(decided.leader, decided.target, decided, **why) if decided.follow else Wait(**why)
    restoring = _restore(view, decided.target if decided.follow else decided.now.upto, why)
    if restoring is not None:
        return restoring
    if decided.follow:
        return Follow(decided.leader, decided.target, decided, **why)  # type: ignore[arg-type]
    if decided.now.kind == "donor":
        return CloneRunning(decided.now.donor, decided.now.upto, **why)  # type: ignore[arg-type]
    return _cached(found, **why)


def place_without_reuse(r: Placed, slot: bool) -> Placement:
    """Where `r` starts when looking up reuse failed (reuse is optional work): a clone that landed for
    it resumes, since it holds that session already; anything else prefills, or waits for its slot."""
    if (resumed := _landed(r)) is not None:
        return resumed
    return Fresh() if slot else Wait()


def _landed(r: Placed) -> Resume | None:
    landed = r.landed
    return Resume(landed.sid, landed.upto, named=False) if landed is not None else None


def _follow_decision(r: Placed, view: View) -> FollowDecision:
    recipient = Recipient(r.rid, r.prompt)
    found = view.found
    donors = [found.donor] if found.donor is not None else []
    now = choose_reuse(recipient, donors, found.cached, view.policy.min_tokens)
    return decide(recipient, view.leaders, now, view.rates, view.policy, view.prefilling)


def _cached(found: Found, **why: Any) -> Cached | Fresh:
    return Cached(tuple(found.memory), **why) if found.memory else Fresh(**why)


def _restore(view: View, memory: int, why: dict[str, Any]) -> Restore | None:
    """The disk tier's file, when it serves more than `memory` (the best match in memory) and the
    cost model expects reading it to beat computing it. When the cost model ran, its choice goes
    into `why` (the log line and the metric) either way."""
    match = view.found.disk
    if not view.restore or match is None or match.upto <= memory or match.upto < view.min_cached:
        return None
    choice = choose_restore(match.upto, match.entry.nbytes, memory, view.rates, view.prefilling)
    why["log"].update(choice.log_fields())
    why["disk_choice"] = choice.reason
    return Restore(match, **why) if choice.restore else None
