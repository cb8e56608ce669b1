"""What rank 0 sends the other ranks (backends/lockstep/wire.py: the step plan's effects), without
ranks: what crosses is msgspec values only, and the broadcasts a LockstepBackend sends, run on a fresh
backend by a Follower, rebuild every session rank 0 holds, at the same positions and with the same
state."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from backend_fixtures import backend_name, logits_np, prompt  # noqa: F401 (fixture)
from kvfork.backends import create_backend
from kvfork.backends import effects as e
from kvfork.backends.lockstep import wire
from kvfork.backends.lockstep.channel import Channel
from kvfork.backends.lockstep.follower import Follower
from kvfork.backends.lockstep.leader import LockstepBackend

EVERY_EFFECT = [  # and Import, whose saved state's arrays tests/engine/test_step_plan.py round-trips
    wire.Load("/models/x", "float32", "share"), e.Open(1), e.Clone(2, 1, 40), e.Prefill([1, 2], [[5, 6], [7]]),
    e.Decode([1, 2], [8, 9]), e.KeepAt(1, (20, 40)), e.MoveCheckpoints(1, 2), e.Export(2), e.Release([1, 3]),
    wire.Stop("bye"),
]


def test_every_effect_round_trips_as_plain_values():
    broadcast = wire.Broadcast(7, EVERY_EFFECT)
    assert wire.decode(wire.encode(broadcast)) == broadcast
    crossed = msgspec.msgpack.decode(wire.encode(broadcast))  # what crosses: maps, lists, strings and numbers
    assert crossed["effects"][2] == {"type": "clone", "sid": 2, "source": 1, "upto": 40}


@pytest.mark.parametrize("payload", [
    {"seq": 1, "effects": [{"type": "exec", "code": "import os"}]},  # no such effect
    {"seq": 1, "effects": [{"type": "open", "sid": "1"}]},  # a field of the wrong type
    # an extra field is dropped, never run
    {"seq": 1, "effects": [{"type": "open", "sid": 1, "extra": b"\x80\x04"}]},
])
def test_a_rank_decodes_nothing_but_the_effects_schema(payload):
    data = msgspec.msgpack.encode(payload)
    if "extra" in payload["effects"][0]:
        assert wire.decode(data).effects == [e.Open(1)]
    else:
        with pytest.raises(msgspec.ValidationError):
            wire.decode(data)


class Recorder(Channel):
    """Rank 0 of a group of one: keeps every buffer it sends, for a replay."""

    rank, size = 0, 1

    def __init__(self):
        self.sent: list[np.ndarray] = []

    def _broadcast(self, buffer):
        self.sent.append(buffer.copy())
        return buffer

    def all_ok(self, ok):
        return ok

    def gather(self, buffer):
        return [buffer]


class Replay(Channel):
    """A follower's view of what the Recorder sent, in order."""

    rank, size = 0, 1  # the Recorder's group of one: a state splits in one part

    def __init__(self, sent):
        self.sent = iter(sent)

    def _broadcast(self, buffer):
        return next(self.sent)

    def all_ok(self, ok):
        return ok

    def gather(self, buffer):
        return None


def test_a_fresh_backend_running_the_broadcasts_holds_rank_0s_sessions(backend_name, tiny_model_dir):  # noqa: F811 (a fixture)
    """Open, prefill, clone, a mixed step, decode, export and import, a release: a fresh backend that
    runs the broadcasts holds the same sessions, which decode to the same logits."""
    leader = LockstepBackend(create_backend(backend_name), Recorder(), timeout=600)
    leader.load(tiny_model_dir("llama"), "float32")
    a = leader.open_session()
    leader.prefill([a], [prompt(40)])
    b = leader.clone(a, 30)
    leader.prefill([a, b], [[7], prompt(5, seed=1)])
    leader.decode([a, b], [11, 12])
    c = leader.import_state(leader.export_state(b))
    leader.release(leader.clone(a, 41))  # a cancelled request's session: released on every rank

    follower = Follower(create_backend(backend_name), Replay(list(leader.channel.sent)))
    with pytest.raises(StopIteration):  # every broadcast run, none left
        while True:
            for effect in wire.decode(follower.channel.broadcast(None)).effects:
                follower.apply(effect)
    held = follower.ex.sessions  # by rank 0's session ids
    assert {sid: s.position for sid, s in held.items()} == {a.id: 42, b.id: 36, c.id: 36}
    for mine in (a, b, c):
        # the same calls on the same shapes, on the same kernels: bit-exact (tolerance.py)
        np.testing.assert_array_equal(logits_np(leader, follower.backend.decode([held[mine.id]], [13])),
                                      logits_np(leader, leader.decode([mine], [13])))
    for s in (a, b, c):
        leader.release(s)
    follower.release_all()


async def test_plans_with_drafts_replayed_through_rank_0_give_the_same_tokens_on_every_rank(backend_name,  # noqa: F811
                                                                                             tiny_model_dir):
    """Recorded plans with drafted rows (verify passes, row-picked sampling, roll backs) replayed through
    rank 0's LockstepBackend give the engine's tokens, and a follower running its broadcasts computes
    every pass's logits as rank 0 did: the rows rank 0 sampled give the same tokens there."""
    from engine_harness import drafted_plans
    from kvfork.server.engine.worker import plan as p

    folder = tiny_model_dir("llama")
    plans, rids, want = await drafted_plans(create_backend(backend_name), folder,
                                            [prompt(20, seed=12), prompt(26, seed=13)])

    passes: dict[str, list[np.ndarray]] = {"leader": [], "follower": []}

    def logged(name: str):
        backend = create_backend(backend_name)
        for call in ("prefill", "decode", "verify"):
            def logging_call(*args, _call=getattr(backend, call)):
                logits = _call(*args)
                passes[name].append(backend.to_numpy(logits))
                return logits
            setattr(backend, call, logging_call)
        return backend

    leader = LockstepBackend(logged("leader"), Recorder(), timeout=600)
    leader.load(folder, "float32")
    replayed = p.replay([p.from_bytes(p.to_bytes(plan)) for plan in plans], leader)
    assert [replayed[rid] for rid in rids] == want
    follower = Follower(logged("follower"), Replay(list(leader.channel.sent)))
    with pytest.raises(StopIteration):  # every broadcast run, none left
        while True:
            for effect in wire.decode(follower.channel.broadcast(None)).effects:
                follower.apply(effect)
    assert any(isinstance(op, e.Truncate) for plan in plans for op in plan.ops)
    assert len(passes["follower"]) == len(passes["leader"]) > 0
    for theirs, mine in zip(passes["follower"], passes["leader"]):
        # the same calls on the same shapes, on the same kernels: bit-exact (tolerance.py)
        np.testing.assert_array_equal(theirs, mine)
    follower.release_all()

