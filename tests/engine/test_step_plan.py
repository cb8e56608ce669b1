"""The step as data (server/engine/worker/plan.py, its ops backends/effects.py's): a step's plan is a plain value
that round-trips through msgspec, and the plans an engine ran, replayed on a fresh backend from themselves
alone, give the same tokens, with every reuse path in play (prefix cache, donor clone, following, n
choices, named session)."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from backend_fixtures import backend_name, prompt  # noqa: F401  (fixture: each importable backend)
from kvfork.backends import create_backend
from kvfork.backends import effects as e
from kvfork.backends.base import KVStorage, SamplingParams, SavedLayer, SavedState
from engine_harness import collect, real_engine, request, until
from kvfork.server.engine.worker import plan as p
from tiny_models import write_model


def every_kind_of_plan() -> p.StepPlan:
    state = SavedState(3, (SavedLayer("full", (np.arange(12, dtype=np.float32).reshape(1, 3, 4),
                                               np.ones((1, 3, 4), np.uint16))),
                           SavedLayer("recurrent", (np.zeros((2, 2), np.float32),), 3)))
    ops = [e.Open(1), e.Clone(2, 1, 40), e.Import(3, state), e.Export(2), e.KeepAt(1, (24, 48)),
           e.MoveCheckpoints(1, 2), e.Release([2, 3])]
    sampling = SamplingParams(temperature=0.7, top_p=0.9, seed=-5, logit_bias={7: -1.5}, logprobs=True, top_logprobs=2)
    return p.StepPlan(9, ops, [p.Sampler(4, sampling, [1, 2, 3])], decode=[p.Row(4, 1, [17], True, False)],
                      prefill=[p.Row(5, 6, [1, 2, 3], False, True)], samples=[p.Sample(4, 4), p.Sample(8, 5)],
                      mixed=True)


def test_a_step_plan_round_trips_through_msgspec():
    plan = every_kind_of_plan()
    back = p.from_bytes(p.to_bytes(plan))
    imported = back.ops[2]
    assert isinstance(imported, e.Import)
    for got, want in zip(imported.state.layers, plan.ops[2].state.layers):  # type: ignore[union-attr]
        assert got.kind == want.kind and got.first == want.first
        for a, b in zip(got.arrays, want.arrays):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert back.ops[:2] + back.ops[3:] == plan.ops[:2] + plan.ops[3:]
    assert (back.samplers, back.decode, back.prefill, back.samples, back.mixed) == (
        plan.samplers, plan.decode, plan.prefill, plan.samples, plan.mixed)
    assert back.samplers[0].params.logit_bias == {7: -1.5}


def test_the_passes_of_a_plan_follow_the_backends_batching():
    plan = every_kind_of_plan()
    assert plan.passes() == [plan.decode + plan.prefill]
    assert [p.pass_of(rows) for rows in plan.passes()] == [e.Prefill([1, 6], [[17], [1, 2, 3]])]
    plan.mixed = False
    assert plan.passes() == [plan.decode, plan.prefill]
    assert [p.pass_of(rows) for rows in plan.passes()] == [e.Decode([1], [17]), e.Prefill([6], [[1, 2, 3]])]


def test_a_drafted_row_shares_the_decode_pass_on_either_batching():
    plan = every_kind_of_plan()
    plan.decode = [*plan.decode, p.Row(2, 7, [30, 31, 32], True, False, 3)]
    plan.mixed = False
    assert [p.pass_of(rows) for rows in plan.passes()] == [e.Verify([1, 7], [[17], [30, 31, 32]], [1, 3]),
                                                          e.Prefill([6], [[1, 2, 3]])]


@pytest.mark.parametrize("array", [
    {"dtype": "|O", "shape": [1], "data": bytes(8)},  # objects: nothing but numbers is built from a plan
    {"dtype": "<f4", "shape": [3], "data": bytes(8)},  # a shape its bytes do not fill
    {"dtype": "<f4", "shape": [2]},  # no bytes
])
def test_a_saved_states_arrays_decode_as_numbers_of_their_shape_only(array):
    state = {"position": 1, "layers": [{"kind": "full", "arrays": [array], "first": 0}]}
    with pytest.raises(msgspec.ValidationError):
        p.from_bytes(msgspec.msgpack.encode({"step": 1, "ops": [{"type": "import", "sid": 1, "state": state}]}))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
async def test_plans_recorded_from_an_engine_replay_on_a_fresh_backend_to_the_same_tokens(backend_name,
                                                                                          tiny_model_dir, tmp_path,
                                                                                          kv_cache_dtype):
    """At int8 (torch; a llama whose heads are 64 wide, so groups of 64 divide them) the replay stores and
    moves the same int8 rows."""
    if kv_cache_dtype != "auto" and backend_name != "torch":
        pytest.skip("MLX stores KV in the weights' dtype only")
    folder = tiny_model_dir("llama") if kv_cache_dtype == "auto" else str(write_model(tmp_path, "llama", head_dim=64))
    plans: list[p.StepPlan] = []
    engine = await real_engine(backend_name, folder, plans=plans.append, prefix_cache_entries=4,
                               active_prefix_reuse_min_tokens=8, prefill_chunk=16, inference_slots=4,
                               kv_cache_dtype=kv_cache_dtype)
    shared = prompt(48, seed=1)
    rids, tokens = {}, {}

    async def run(name: str, tokens_of: list[int], **kw) -> None:
        handle = engine.submit(request(tokens_of, 6, rid=name, ignore_eos=True, **kw))
        rids[name] = next(r.rid for r in engine.requests() if r.handle is handle)
        tokens[name] = (await collect(handle))[0]

    await run("first", shared + prompt(4, seed=2))
    await run("cached", shared + prompt(6, seed=3))  # a clone of the prefix cache's snapshot
    leader = engine.submit(request(shared + prompt(40, seed=4), 6, rid="leader", ignore_eos=True))
    await until(lambda: any(r.committed > 0 for r in engine.requests()))
    await asyncio.gather(run("follower", shared + prompt(40, seed=4)[:30] + [7]), run("other", prompt(20, seed=5)))
    await collect(leader)
    choices = engine.submit_choices(request(prompt(30, seed=6), 6, rid="choices", ignore_eos=True, n=2))
    lead = next(r for r in engine.requests() if r.handle is choices[0])
    chosen = [(await collect(h))[0] for h in choices]
    await run("turn", prompt(24, seed=7), session_id="s")
    await run("again", prompt(24, seed=7) + tokens["turn"] + [9, 9], session_id="s")
    await engine.shutdown(1)

    fresh = create_backend(backend_name)
    fresh.set_kv_storage(KVStorage.named(kv_cache_dtype))
    fresh.load(folder, "float32")
    replayed = p.replay([p.from_bytes(p.to_bytes(plan)) for plan in plans], fresh)
    assert {name: replayed[rid] for name, rid in rids.items()} == tokens
    assert [replayed[lead.rid], replayed[lead.siblings[0].rid]] == chosen
    assert any(isinstance(op, e.Clone) for plan in plans for op in plan.ops)  # reuse took part
