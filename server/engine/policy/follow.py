"""Follow the leader: requests that share a prompt prefix share one prefill. Pure policy.

The engine calls (and RateTracker from rates.py: .observe_prefill(tokens, s),
.observe_clone(tokens, s), .rates -> Rates):
  Leader.active(source, tps) -> Leader          # an admitted request, prefilling or decoding
  Leader.starting(source, at, after_s, tps) -> Leader   # an admitted request whose clone is pending
  leader_views(active, parked, rates, tps) -> list[Leader]   # + the parked followers, as leaders
  decide(recipient, leaders, now, rates, policy, prefilling) -> FollowDecision  # now: choose_reuse's clone-now
  FollowDecision.log_fields() -> dict                     # the decision and its inputs, for the log line
  FollowOrder.park(request_id, decision, order, first_parked_at, max_wait_s) -> FollowOrder
  chunk_end(committed, planned_end, stops) -> int   # where a leader's prefill chunk stops
  promote(gone, gone_committed, parked, state_usable) -> Promotion   # the runner, via clone_orders.py

Engine flow:
  - Admitting an anonymous text request (on arrival, or when a slot frees), with
    now = matching.choose_reuse(recipient, the best donor, the best cached match, min_tokens):
    p = decide(Recipient(...), leaders, now, tracker.rates, policy, prefilling).
    p.follow: park it (FollowOrder.park), holding no slot but counted in the queue
    and its timeout. Otherwise take p.now, exactly matching.choose_reuse's choice
    (so --no-follow is FollowPolicy(follow=False), nothing else). Log p.log_fields().
  - Each step: a leader's prefill chunk ends at chunk_end() of its followers'
    targets; the runner clones [0, target) for a follower the moment its leader
    has committed it, and the follower prefills its tail once it has a slot.
  - At a follower's deadline, at_deadline() compares costs with the leader's
    measured progress: while following is still expected to answer sooner, it
    goes on (and looks again); else it is unparked and planned again with
    FollowPolicy(follow=False): clone-now.
  - A leader leaving while followed (cancelled, failed, or finished): promote();
    the heir clones the gone state; everyone else below the gone leader is
    unparked and plans again in order, each with max_wait_s = what is left to its
    deadline.
  - Any refused clone falls back to clone-now: normal admission, fresh cache lookup.

Rules (each also stated where it binds):
  - Grouping: a recipient follows the leader offering the longest match it will
    have, min(common prefix, len - 1), whose wait fits follow_max_wait; ties go to
    the leader reaching it soonest, then the earliest. Leaders are the admitted
    requests and the parked followers (a follower becomes a leader once it clones).
    So in a burst the earliest request prefills the shared part and the others
    follow it: no two requests prefill the same shared tokens at once.
  - It follows only when the cost model expects a TTFT no worse than clone-now
    (clone what is committed / cached prefix / full prefill), and when the match
    beats the cached one by min_tokens. Otherwise clone-now's choice stands
    unchanged; follow=False (--no-follow) gives exactly clone-now.
  - A leader that goes away offers its committed prefix to the follower that
    salvages most (the heir), cloned at once; the heir then waits for a slot
    like any follower whose clone landed, and everyone else below the gone
    leader plans again and finds the heir.
  - Only requests nobody follows are decided with following on (new, queued, or
    unparked by promote), so no request ever follows its own follower.
  - A follower holds no slot (but the bytes of its clone, in the budget) and
    looks again at its deadline, which runs from the first time it parked: it
    goes on only while its leader's measured progress makes that cheaper than
    clone-now, so no follower waits on a stalled leader.
Cost: run `decide` on arrival and at admission, not per step: with 256 parked
followers of 2,000-token prompts, leader_views + decide take ~2 ms (a parked
follower is compared only beyond its leader's part). Per step only `chunk_end`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Literal, Sequence

from kvfork.server.engine.policy.matching import Recipient, ReuseChoice, Source, common_prefix
from kvfork.server.engine.policy.rates import Rates


@dataclass(frozen=True)
class Leader:
    """A request whose prompt others may wait for, with when its committed position moves.

    Position over time: source.committed until start_s, then start_at, then
    + tps per second. An admitted request starts now; a parked follower starts
    when its own clone lands.
    """

    source: Source  # committed = what it holds NOW (0 for a parked follower)
    start_s: float
    start_at: int
    tps: float
    follows: Hashable | None = None  # a parked follower's leader: its prompt agrees with it on [0, start_at)

    @classmethod
    def active(cls, source: Source, tps: float) -> Leader:
        """`tps`: its expected prefill rate, e.g. rates.share(prefilling); moot once decoding."""
        return cls(source, 0.0, source.committed, tps)

    @classmethod
    def starting(cls, source: Source, at: int, after_s: float, tps: float, follows: Hashable | None = None) -> Leader:
        """Holds nothing usable yet; holds [0, at) in `after_s` seconds, then prefills on.

        A request whose clone is pending (a recipient, an heir): after_s = rates.clone_s(at).
        """
        return cls(source, after_s, at, tps, follows)

    def eta(self, position: int) -> float:
        """Seconds until the committed position reaches `position`."""
        if position <= self.source.committed:
            return 0.0
        if position <= self.start_at:
            return self.start_s
        return self.start_s + (position - self.start_at) / self.tps if self.tps > 0 else math.inf


def leader_views(active: Iterable[Leader], parked: Iterable[tuple[FollowOrder, Source]], rates: Rates,
                 tps: float) -> list[Leader]:
    """Everyone a newcomer may follow: `active` (Leader.active of each admitted
    request), then each parked follower with its prompt's Source (committed 0: it
    holds nothing yet), IN THE ORDER THEY PARKED, each seen as starting when its
    own leader reaches its target and the clone lands. `tps`: the rate a follower
    will prefill at once it starts.
    """
    # A follower parks after its leader is a leader, and a re-planned one parks
    # again after it, so park order builds every leader's view before its followers'.
    views = {lead.source.key: lead for lead in active}
    for f, source in parked:
        lead = views.get(f.leader)
        after = (lead.eta(f.target) if lead else math.inf) + rates.clone_s(f.target)
        views[f.request_id] = Leader.starting(source, f.target, after, tps, f.leader)
    return list(views.values())


@dataclass(frozen=True)
class FollowPolicy:
    min_tokens: int  # --active-prefix-reuse-min-tokens; 0 disables reuse, following included
    follow: bool = True  # --no-follow: clone-now exactly
    max_wait_s: float = 120.0  # --follow-max-wait: a safety net for a stalled leader, above a long CPU prefill


FollowReason = Literal["follow", "off", "no_leader", "below_threshold", "too_long", "slower"]


@dataclass(frozen=True)
class FollowDecision:
    follow: bool  # park behind `leader` until it commits `target`; else take `now` (clone-now's choice)
    now: ReuseChoice
    leader: Hashable | None
    target: int
    wait_s: float  # expected, when following
    # Expected TTFTs, None where the option does not exist:
    ttft_clone_s: float | None  # clone what the best donor has committed now, prefill the rest
    ttft_alone_s: float  # cached prefix (if any) and prefill the rest
    ttft_follow_s: float | None  # wait for the leader, clone [0, target), prefill the tail
    reason: FollowReason
    rates: Rates
    prefilling: int

    @property
    def ttft_now_s(self) -> float:
        """Expected TTFT of clone-now's choice."""
        return self.ttft_clone_s if self.now.kind == "donor" and self.ttft_clone_s is not None else self.ttft_alone_s

    def log_fields(self) -> dict:
        def secs(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {**self.now.log_fields(), "follow": self.follow, "follow_reason": self.reason, "leader": self.leader,
                "follow_target": self.target, "follow_wait_s": secs(self.wait_s),
                "ttft_clone_s": secs(self.ttft_clone_s), "ttft_alone_s": secs(self.ttft_alone_s),
                "ttft_follow_s": secs(self.ttft_follow_s), "prefill_tps": round(self.rates.prefill_tps, 1),
                "clone_fixed_s": self.rates.clone_fixed_s, "clone_s_per_token": self.rates.clone_s_per_token,
                "prefilling": self.prefilling}


def decide(recipient: Recipient, leaders: Sequence[Leader], now: ReuseChoice, rates: Rates, policy: FollowPolicy,
         prefilling: int) -> FollowDecision:
    """Follow a leader, or take clone-now's choice `now` (matching.choose_reuse, with the best
    prefix-cache match `now.cached_match`).

    `leaders`: admitted requests and parked followers (see Leader); `prefilling`:
    requests prefilling now, the recipient not counted (it would share the prefill
    rate with them).
    """
    cached = now.cached_match
    tps = rates.share(prefilling + 1)
    length = len(recipient.prompt)

    def ttft(wait: float, reused: int) -> float:
        return wait + rates.clone_s(reused) + (length - reused) / tps

    ttft_clone = ttft(0.0, now.donor_match) if now.donor_match > 0 else None
    ttft_alone = ttft(0.0, now.upto if now.kind != "donor" else cached)

    def result(reason: FollowReason, lead: Leader | None = None, target: int = 0) -> FollowDecision:
        wait = lead.eta(target) if lead else 0.0
        return FollowDecision(reason == "follow", now, lead.source.key if lead else None, target, wait, ttft_clone,
                    ttft_alone, ttft(wait, target) if lead else None, reason, rates, prefilling)

    if not policy.follow or now.reason in ("disabled", "named_session", "not_text"):
        return result("off")
    best: tuple[int, float, int] | None = None
    chosen: Leader | None = None
    too_long = False
    shared: dict[Hashable, int] = {}  # common prefix with each leader compared so far
    for lead in leaders:
        if lead.source.key == recipient.request_id or not lead.source.text:
            continue
        # the match it will have once committed: its prompt only, never generated output
        shared[lead.source.key] = _shared_prefix(recipient.prompt, lead, shared)
        target = min(shared[lead.source.key], length - 1)
        # Nothing to wait for once the leader holds the target: clone-now
        # already weighed it (and a sliding window may have dropped it since).
        if target <= now.upto or target <= lead.source.committed:
            continue
        eta = lead.eta(target)
        if eta > policy.max_wait_s:  # follow_max_wait bounds every wait
            too_long = True
            continue
        # longest match first, then the soonest there, then the earliest request
        rank = (target, -eta, -lead.source.recency)
        if best is None or rank > best:
            best, chosen = rank, lead
    if chosen is None or best is None:
        return result("too_long" if too_long else "no_leader")
    target = best[0]
    if target - cached < policy.min_tokens:
        return result("below_threshold", chosen, target)
    decided = result("follow", chosen, target)
    assert decided.ttft_follow_s is not None
    # Ties follow: the same wait for fewer prefill tokens, which frees compute for
    # others. The tolerance keeps float rounding from breaking exact ties.
    faster = decided.ttft_follow_s <= decided.ttft_now_s * (1 + 1e-9)
    return decided if faster else result("slower", chosen, target)


def _shared_prefix(prompt: Sequence[int], lead: Leader, known: dict[Hashable, int]) -> int:
    # A parked follower's prompt agrees with its leader's on [0, start_at). If the
    # recipient leaves the leader's prompt before that, it leaves the follower's
    # there too; otherwise only the follower's own part needs comparing. In a
    # burst this makes the hundreds of parked followers nearly free to scan.
    start = 0
    if lead.follows in known:
        before = known[lead.follows]
        if before < lead.start_at:
            return before
        start = lead.start_at
    return common_prefix(prompt, lead.source.tokens, start)


@dataclass(frozen=True)
class FollowOrder:
    """A parked request. It holds no inference slot and counts against the queue limits."""

    request_id: Hashable
    leader: Hashable
    target: int  # clone [0, target) from the leader once it has committed that much
    order: int  # arrival order, lower = earlier
    deadline: float  # engine clock; then at_deadline() says whether it goes on following

    @classmethod
    def park(cls, request_id: Hashable, decision: FollowDecision, order: int, first_parked_at: float,
             max_wait_s: float) -> FollowOrder:
        # The deadline runs from the FIRST time the request parked: a follower that
        # parks again after a promotion keeps it, so no follower waits forever.
        assert decision.follow and decision.leader is not None
        return cls(request_id, decision.leader, decision.target, order, first_parked_at + max_wait_s)


@dataclass(frozen=True)
class Expiry:
    """A follower's deadline came: go on following (and look again in `recheck_s`), or stop."""

    keep: bool
    recheck_s: float
    ttft_follow_s: float  # expected, from now, going on following
    ttft_now_s: float  # expected, from now, cloning what the leader has committed and prefilling the rest


def at_deadline(length: int, target: int, committed: int, progress_tps: float, rates: Rates, prefilling: int,
                max_wait_s: float) -> Expiry:
    """At its deadline, a follower goes on following while that is still expected to answer sooner
    than clone-now: cloning the leader's `committed` prefix and prefilling the rest itself.

    `progress_tps`: how fast the leader's committed position really moved since the follower last
    looked (a stalled leader: 0, and following ends); `prefilling`: requests prefilling now, the
    leader among them, the follower not; `max_wait_s`: --follow-max-wait, the longest it goes
    without looking again. Deadlines keep coming, so no follower waits on a leader that stops moving.
    """
    # The follower would prefill beside the others: its share of the rate, no faster than the leader
    # really moved (a machine that slowed down since the rates were measured slows both).
    tps = rates.share(prefilling + 1)
    if progress_tps > 0:
        tps = min(tps, progress_tps * prefilling / (prefilling + 1))
    held = min(committed, target)
    wait = (target - held) / progress_tps if progress_tps > 0 else math.inf
    ttft_follow = wait + rates.clone_s(target) + (length - target) / tps
    ttft_now = rates.clone_s(held) + (length - held) / tps
    keep = ttft_follow < ttft_now
    # It looks again a whole wait later: on a loaded machine one step can take many seconds, and a
    # shorter look could see no commit and take a moving leader for a stalled one.
    return Expiry(keep, max_wait_s if keep else 0.0, ttft_follow, ttft_now)


def chunk_end(committed: int, planned_end: int, stops: Iterable[int]) -> int:
    """Where a leader's prefill chunk [committed, planned_end) ends: its followers' targets inside it cut it.

    `stops`: the targets of the requests following it.
    """
    # A sliding-window layer keeps only its last W positions, so a clone at
    # `target` must be taken before the leader writes far past it
    # (backends.base.clone_refusal): the chunk stops there and the runner serves
    # the ready followers' clones before the leader's next write.
    return min((s for s in stops if committed < s < planned_end), default=planned_end)


@dataclass(frozen=True)
class Promotion:
    heir: Hashable | None  # offered the gone leader's state
    upto: int  # what the heir salvages: min(its target, gone_committed)


def promote(gone: Hashable, gone_committed: int, parked: Iterable[FollowOrder], state_usable: bool = True) -> Promotion:
    """A leader is leaving with followers parked on it (`parked`: at least those).

    `gone_committed`: its committed position; `state_usable`: False when its state
    cannot be cloned (a failed step). The runner clones the heir's [0, upto) at
    once, BEFORE the gone state is released.
    """
    # The heir is the direct follower that salvages most of what the leader
    # committed (ties: the earliest), so as little as possible is computed again.
    def salvage(f: FollowOrder) -> int:
        return min(f.target, gone_committed) if state_usable else 0

    direct = sorted((f for f in parked if f.leader == gone), key=lambda f: f.order)
    heir = max(direct, key=salvage, default=None)
    if heir is None or salvage(heir) <= 0:
        return Promotion(None, 0)
    return Promotion(heir.request_id, salvage(heir))
