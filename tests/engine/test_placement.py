"""Where a request starts (server/engine/policy/placement.py): `place` over hand-built Views, without a backend
or an engine. Each rule in turn: fresh, cached, clone (clone-now), follow, restore (the disk tier), a named
session's resume and a landed clone's, and `place_without_reuse`; with the boundaries of each (the
minimum a reuse must save, a donor too short, a file's read against recomputing it)."""

from __future__ import annotations

import pytest

from kvfork.backends.base import SamplingParams
from kvfork.server.engine.api import GenerateRequest
from kvfork.server.engine.policy.entries import Entry, Found, Match
from kvfork.server.engine.policy.follow import FollowPolicy, Leader
from kvfork.server.engine.policy.matching import Source
from kvfork.server.engine.policy.placement import (Cached, CloneRunning, Follow, Fresh, Restore, Resume, View, Wait, place,
                                            place_without_reuse)
from kvfork.server.engine.cache.sessions import NamedSession
from kvfork.server.engine.loop.request import Landed, Queued, Request, RequestHandle
from kvfork.server.engine.policy.rates import Rates

SCOPE = "scope-a"
MIN = 64  # --active-prefix-reuse-min-tokens and --prefix-cache-min-tokens, as the daemon's defaults
PROMPT = list(range(3, 203))  # 200 tokens
OTHER = [1000 + t for t in PROMPT]  # shares nothing with PROMPT
RID, DONOR, LEADER = 5, 2, 3


def request(prompt=PROMPT, rid=RID, named: NamedSession | None = None, landed: Landed | None = None) -> Request:
    handle = RequestHandle(f"req-{rid}", lambda: None, lambda: None)
    r = Request(rid, GenerateRequest(f"req-{rid}", list(prompt), SamplingParams(), 8), handle, 8, frozenset(), 0,
                named=named)
    r.phase = Queued(landed)
    return r


def entry(tier, tokens, sid=None, nbytes=0, scope=SCOPE) -> Entry:
    return Entry(tier, scope, tuple(tokens), sid=sid, nbytes=nbytes)


def cached(upto: int, sid: int = 7) -> Match:
    """A prefix cache entry in memory serving PROMPT[:upto)."""
    return Match(entry("memory", PROMPT[:upto] + OTHER[:10], sid=sid), upto)


def on_disk(upto: int, nbytes: int) -> Match:
    return Match(entry("disk", PROMPT[:upto] + OTHER[:10], nbytes=nbytes), upto)


def donor(committed: int, shared: int = 180, **kw) -> Source:
    """A running request whose prompt shares `shared` tokens with PROMPT, `committed` of them computed."""
    return Source.donor(DONOR, PROMPT[:shared] + OTHER[:40], committed, DONOR, **kw)


def leader(committed: int, shared: int = 180, tps: float = 500.0) -> Leader:
    return Leader.active(Source.donor(LEADER, PROMPT[:shared] + OTHER[:40], committed, LEADER), tps)


def view(memory=(), disk=None, source=None, leaders=(), rates=Rates(), prefilling=0, min_tokens=MIN, follow=True,
         max_wait_s=120.0, restore=True, slot=True) -> View:
    found = Found(SCOPE, list(memory), disk, source)
    return View(found, list(leaders), rates, prefilling, FollowPolicy(min_tokens, follow, max_wait_s), MIN, restore,
                slot, {DONOR: "donor-request", LEADER: "leader-request"})


# ---- fresh, cached, and active reuse off ----

def test_nothing_to_reuse_prefills_it_all():
    placed = place(request(), view())
    assert isinstance(placed, Fresh) and placed.cached == 0
    assert placed.follow_choice == "no_leader" and placed.log["reuse_reason"] == "no_donor"


def test_the_prefix_cache_serves_its_matches_best_first():
    matches = (cached(120, sid=7), cached(100, sid=8))
    placed = place(request(), view(memory=matches))
    assert placed == Cached(matches, log=placed.log, follow_choice="no_leader", cached=120)
    assert placed.log["reuse"] == "cache" and placed.log["reuse_upto"] == 120


@pytest.mark.parametrize("memory", [(), (cached(120),)])
def test_active_reuse_off_takes_the_cache_and_never_a_donor_nor_a_leader(memory):
    r = request()
    r.decision["clone_refused"] = 4
    placed = place(r, view(memory=memory, source=donor(180), leaders=[leader(20)], min_tokens=0))
    assert type(placed) is (Cached if memory else Fresh)
    assert placed.follow_choice is None and placed.log == {"clone_refused": 4}  # follow.decide never ran


# ---- clone-now: a running donor's committed prefix ----

def test_a_donor_holding_more_than_the_minimum_is_cloned():
    placed = place(request(), view(source=donor(committed=150)))
    assert isinstance(placed, CloneRunning) and (placed.donor, placed.upto) == (DONOR, 150)
    assert placed.log["donor"] == "donor-request"  # named as the client named it


def test_a_donor_serves_at_most_the_shared_prefix_and_never_the_last_prompt_token():
    assert place(request(), view(source=donor(committed=190, shared=180))).upto == 180
    whole = Source.donor(DONOR, PROMPT + OTHER[:5], 300, DONOR)
    assert place(request(), view(source=whole)).upto == len(PROMPT) - 1


@pytest.mark.parametrize("committed, kind", [(MIN, CloneRunning), (MIN - 1, Fresh)])
def test_the_minimum_is_what_a_donor_must_save(committed, kind):
    assert type(place(request(), view(source=donor(committed)))) is kind


@pytest.mark.parametrize("committed, kind", [(100 + MIN, CloneRunning), (100 + MIN - 1, Cached)])
def test_the_minimum_is_counted_beyond_the_best_cached_match(committed, kind):
    placed = place(request(), view(memory=[cached(100)], source=donor(committed)))
    assert type(placed) is kind
    if kind is Cached:
        assert placed.log["reuse_reason"] == "below_threshold" and placed.cached == 100


def test_a_donor_too_short_or_whose_window_forgot_the_prefix_is_not_cloned():
    assert isinstance(place(request(), view(source=donor(committed=170, shared=MIN - 1))), Fresh)
    assert isinstance(place(request(), view(source=donor(committed=0))), Fresh)
    forgot = donor(committed=180, clone_floor=181)  # a sliding window past the shared part
    assert isinstance(place(request(), view(source=forgot)), Fresh)


def test_a_cached_match_as_long_as_the_donors_wins():
    placed = place(request(), view(memory=[cached(150)], source=donor(150)))
    assert isinstance(placed, Cached) and placed.log["reuse_reason"] == "cache_wins"


# ---- follow: park behind a leader until it commits the shared prefix ----

def test_a_leader_still_prefilling_the_shared_part_is_followed():
    placed = place(request(), view(leaders=[leader(committed=20)], prefilling=1))
    assert isinstance(placed, Follow) and (placed.leader, placed.target) == (LEADER, 180)
    assert placed.decided.follow and placed.follow_choice == "follow"
    assert placed.log["leader"] == "leader-request"


def test_without_a_slot_only_following_is_placed_everything_else_waits():
    assert isinstance(place(request(), view(leaders=[leader(20)], prefilling=1, slot=False)), Follow)
    assert isinstance(place(request(), view(source=donor(180), memory=[cached(100)], slot=False)), Wait)  # a clone with one
    assert isinstance(place(request(), view(slot=False)), Wait)


@pytest.mark.parametrize("case, why", [
    (dict(follow=False), "off"),  # --no-follow, or a follow that failed before (Tried.no_follow)
    (dict(max_wait_s=0.1), "too_long"),  # 160 tokens at 500 tokens/s: 0.32 s
    (dict(memory=[cached(180 - MIN + 1)]), "below_threshold"),  # the leader would save one token too few
    (dict(leaders=[leader(20, shared=MIN - 1)]), "below_threshold"),
    (dict(leaders=[leader(20, tps=5.0)]), "slower"),  # prefilling alone is sooner
])
def test_a_leader_is_not_followed_when(case, why):
    placed = place(request(), view(**{"leaders": [leader(20)], "prefilling": 1, **case}))
    assert not isinstance(placed, Follow) and placed.follow_choice == why


def test_a_leader_that_already_holds_the_target_is_cloned_now_not_followed():
    placed = place(request(), view(source=donor(180), leaders=[leader(180)]))
    assert isinstance(placed, CloneRunning) and placed.upto == 180 and placed.follow_choice == "no_leader"


# ---- restore: the disk tier, when reading the file beats computing it ----

# Round numbers: reading N bytes takes N ms, prefilling takes 10 ms a token, cloning costs nothing.
EXACT = Rates(prefill_tps=100.0, clone_fixed_s=0.0, clone_s_per_token=0.0, read_bps=1000.0)


@pytest.mark.parametrize("nbytes, kind, why", [(1499, Restore, "restore"), (1500, Fresh, "slower")])
def test_a_file_is_read_only_when_that_beats_recomputing_it(nbytes, kind, why):
    placed = place(request(), view(disk=on_disk(150, nbytes), rates=EXACT))  # recompute: 150 tokens, 1.5 s
    assert type(placed) is kind and placed.disk_choice == why
    assert placed.log["disk_restore_s"] == round(nbytes / 1000, 4)


def test_recomputing_counts_only_what_the_memory_match_leaves():
    # 100 tokens in memory: the file saves 50, 0.5 s of prefill, which a 0.6 s read does not beat
    placed = place(request(), view(memory=[cached(100)], disk=on_disk(150, 600), rates=EXACT))
    assert isinstance(placed, Cached) and placed.disk_choice == "slower"
    assert isinstance(place(request(), view(memory=[cached(100)], disk=on_disk(150, 400), rates=EXACT)), Restore)


@pytest.mark.parametrize("case", [
    dict(memory=[cached(150)]),  # serves no more than memory does
    dict(disk=on_disk(MIN - 1, 10)),  # under --prefix-cache-min-tokens
    dict(restore=False),  # the tier is off, or failed this request before (Tried.no_disk)
    dict(slot=False),  # no slot: it waits, and is placed again with one
])
def test_the_cost_model_does_not_run_when(case):
    placed = place(request(), view(**{"disk": on_disk(150, 10), "rates": EXACT, **case}))
    assert not isinstance(placed, Restore) and placed.disk_choice is None


def test_a_file_longer_than_the_follow_target_or_the_donors_prefix_is_read_instead():
    disk = on_disk(199, 10)
    assert isinstance(place(request(), view(disk=disk, leaders=[leader(20)], prefilling=1)), Restore)
    assert isinstance(place(request(), view(disk=disk, source=donor(180))), Restore)
    assert isinstance(place(request(), view(disk=disk, min_tokens=0)), Restore)  # with active reuse off too


# ---- named sessions and landed clones: a state it holds already ----

def named(tokens, scope=SCOPE) -> NamedSession:
    return NamedSession("chat", state=entry("named", tokens, sid=11, scope=scope))


def test_a_named_session_resumes_its_own_state_whatever_else_there_is():
    r = request(named=named(PROMPT[:150]))
    placed = place(r, view(memory=[cached(180)], source=donor(190), leaders=[leader(20)], disk=on_disk(199, 1)))
    assert placed == Resume(11, 150, named=True)


@pytest.mark.parametrize("session", [
    NamedSession("chat"),  # holds nothing yet
    named(OTHER[:150]),  # a prompt that does not extend it
    named(PROMPT),  # all of the prompt: the last token must run again
    named(PROMPT[:150], scope="scope-b"),  # another salt computed it
])
def test_a_named_session_that_cannot_resume_starts_cold_and_takes_no_other_reuse(session):
    placed = place(request(named=session), view(memory=[cached(180)], source=donor(190), disk=on_disk(199, 1)))
    assert placed == Fresh()


@pytest.mark.parametrize("slot", [True, False])
def test_a_clone_that_landed_while_it_waited_resumes_without_a_lookup(slot):
    r = request(landed=Landed(sid=9, upto=120))
    assert place(r, view(memory=[cached(180)], source=donor(190), slot=slot)) == Resume(9, 120, named=False)
    assert place_without_reuse(r, slot) == Resume(9, 120, named=False)


# ---- place_without_reuse: the lookup or the choice raised ----

def test_without_reuse_it_prefills_or_waits_for_its_slot():
    assert place_without_reuse(request(), slot=True) == Fresh()
    assert place_without_reuse(request(), slot=False) == Wait()
    assert place_without_reuse(request(named=named(PROMPT[:150])), slot=True) == Fresh()

