"""The plan rank 0 sends the other ranks, without ranks: what crosses is msgspec values only, and the
plans a LockstepBackend sends, applied to a fresh backend by a Follower, rebuild every session rank 0
holds, at the same positions and with the same state."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from backend_fixtures import backend_name, logits_np, prompt  # noqa: F401 (fixture)
from backends import create_backend
from backends.lockstep import plan as p
from backends.lockstep.channel import Channel
from backends.lockstep.follower import Follower
from backends.lockstep.leader import LockstepBackend

EVERY_EFFECT = [
    p.Load("/models/x", "float32", "share"), p.Open(1), p.Clone(2, 1, 40), p.Prefill([1, 2], [[5, 6], [7]]),
    p.Decode([1, 2], [8, 9]), p.KeepAt(1, [20, 40]), p.MoveCheckpoints(1, 2), p.Export(2),
    p.Import(3, 48, [p.LayerSpec("full", 0, [p.ArraySpec([2, 48, 16], "<f4")] * 2)]), p.Release([1, 3]), p.Stop("bye"),
]


def test_every_effect_round_trips_as_plain_values():
    plan = p.Plan(7, EVERY_EFFECT)
    assert p.decode(p.encode(plan)) == plan
    wire = msgspec.msgpack.decode(p.encode(plan))  # what crosses: maps, lists, strings and numbers
    assert wire["effects"][2] == {"type": "clone", "sid": 2, "source": 1, "upto": 40}


@pytest.mark.parametrize("payload", [
    {"step": 1, "effects": [{"type": "exec", "code": "import os"}]},  # no such effect
    {"step": 1, "effects": [{"type": "open", "sid": "1"}]},  # a field of the wrong type
    # an extra field is dropped, never run
    {"step": 1, "effects": [{"type": "open", "sid": 1, "extra": b"\x80\x04"}]},
])
def test_a_rank_decodes_nothing_but_the_plan_schema(payload):
    data = msgspec.msgpack.encode(payload)
    if "extra" in payload["effects"][0]:
        assert p.decode(data).effects == [p.Open(1)]
    else:
        with pytest.raises(msgspec.ValidationError):
            p.decode(data)


class Recorder(Channel):
    """Rank 0 of a group of one: keeps every plan and state buffer it sends, for a replay."""

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


def test_replayed_plans_rebuild_rank_0s_sessions(backend_name, tiny_model_dir):  # noqa: F811 (a fixture)
    """Open, prefill, clone, a mixed step, decode, export and import, a release: a fresh backend that
    applies the plans holds the same sessions, which decode to the same logits."""
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
    with pytest.raises(StopIteration):  # every plan applied, none left
        while True:
            for effect in p.decode(follower.channel.broadcast(None)).effects:
                follower.apply(effect)
    held = follower.sessions
    assert {wire: s.position for wire, s in held.items()} == {1: 42, 2: 36, 3: 36}
    for mine, wire in ((a, 1), (b, 2), (c, 3)):
        # the same calls on the same shapes, on the same kernels: bit-exact (tolerance.py)
        np.testing.assert_array_equal(logits_np(leader, follower.backend.decode([held[wire]], [13])),
                                      logits_np(leader, leader.decode([mine], [13])))
    for s in (a, b, c):
        leader.release(s)
    follower.release_all()
