"""Every transition of a request's phase (server/engine/loop/request.py), each the one way into its phase: what
it keeps, what it carries across, and the phases it refuses to leave from (an engine bug, WrongPhase)."""

import pytest

from kvfork.backends.base import SamplingParams
from kvfork.server.engine.api import GenerateRequest
from kvfork.server.engine.policy.entries import Match
from kvfork.server.engine.loop import request as rq
from kvfork.server.engine.policy.follow import FollowOrder


def fresh(rid: int = 1) -> rq.Request:
    handle = rq.RequestHandle(f"r{rid}", on_cancel=lambda: None, on_finish=lambda: None)
    return rq.Request(rid, GenerateRequest(f"r{rid}", [1, 2, 3], SamplingParams(), 4), handle, 4, frozenset(), 0)


def order() -> FollowOrder:
    return FollowOrder("r1", "r0", target=2, order=0, deadline=10.0)


def test_a_request_walks_queued_prefilling_decoding_finished():
    r = fresh()
    assert isinstance(r.phase, rq.Queued) and r.phase.landed is None
    p = rq.prefill(r, cached=1, donor_upto=2)
    assert (p.cached, p.donor_upto, p.started) == (1, 2, False)
    p = rq.started(r, reused=2)
    assert (p.started, p.donor_upto, p.committed) == (True, 0, 2)  # the donor's clone is done with
    p.checkpoints = (1,)
    d = rq.decode(r)
    assert isinstance(r.phase, rq.Decoding) and (d.committed, d.checkpoints) == (2, (1,))  # carried across
    f = rq.finish(r, "length")
    assert isinstance(r.phase, rq.Finished) and (f.reason, f.error) == ("length", None)


def test_parking_and_back_to_the_queue_with_what_landed():
    r = fresh()
    f = rq.follow(r, order(), cached=1, now=5.0, leader_committed=2)
    assert (f.cached, f.seen, r.tried.first_parked_at) == (1, (5.0, 2), 5.0)
    q = rq.queue(r, rq.Landed(sid=7, upto=2))
    assert q.landed == rq.Landed(7, 2)
    rq.follow(r, order(), cached=1, now=9.0, leader_committed=2)
    assert r.tried.first_parked_at == 5.0  # the follow deadline runs from the first park, across re-parks
    rq.queue(r)
    match = Match(entry=object(), upto=3)  # type: ignore[arg-type]
    assert rq.restore(r, match).match is match
    rq.queue(r, rq.Landed(sid=8, upto=3))
    assert isinstance(rq.prefill(r), rq.Prefilling)


def test_a_refused_donor_clone_starts_again_from_prefilling():
    r = fresh()
    rq.prefill(r, donor_upto=2)
    assert rq.prefill(r).donor_upto == 0


@pytest.mark.parametrize("phase, moves", [
    ("queued", [rq.started, rq.decode]),
    ("following", [rq.follow, rq.restore, rq.prefill, rq.started, rq.decode]),
    ("prefilling", [rq.queue, rq.follow, rq.restore]),
    ("decoding", [rq.queue, rq.follow, rq.restore, rq.prefill, rq.started, rq.decode]),
    ("finished", [rq.queue, rq.follow, rq.restore, rq.prefill, rq.started, rq.decode, rq.finish]),
])
def test_no_transition_leaves_a_phase_it_does_not_leave_from(phase, moves):
    args = {rq.follow: (order(), 0, 0.0, 0), rq.restore: (Match(entry=object(), upto=1),), rq.started: (0,),
            rq.finish: ("stop",)}
    for move in moves:
        r = fresh()
        {"queued": lambda: None, "following": lambda: rq.follow(r, order(), 0, 0.0, 0),
         "prefilling": lambda: rq.prefill(r), "decoding": lambda: (rq.prefill(r), rq.decode(r)),
         "finished": lambda: rq.finish(r, "stop")}[phase]()
        before = r.phase
        with pytest.raises(rq.WrongPhase):
            move(r, *args.get(move, ()))
        assert r.phase is before  # a refused transition changes nothing
