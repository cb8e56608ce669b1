"""The engine on a hybrid model (Qwen3.5: Gated DeltaNet beside full attention), every reuse path
on, against reuse off (float32): the same greedy tokens, and no error where a reuse is refused.

A recurrent state serves a clone only at its position or at a checkpoint (the recurrent rule, base.clone_positions),
so the engine plans for it: the prefix cache snapshots a prompt one token before its end (where an
identical prompt's match stops), a running request keeps checkpoints at its last message boundaries,
a leader's chunk stops at its followers' target, and a named session resumes at its own end."""

import asyncio

import pytest

from backend_fixtures import backend_name, prompt  # noqa: F401  (fixture: each importable backend)
from engine_harness import REUSE_OFF, collect, reached, real_engine, references, request, run, settled, until
from kvfork.server.engine.loop.request import Following
from scripted_backend import Gate

ON = dict(prefix_cache_entries=8, active_prefix_reuse_min_tokens=8)


@pytest.fixture
def folder(backend_name, tiny_hybrid_dir) -> str:
    return tiny_hybrid_dir("qwen3_5")


async def test_prefix_cache_on_a_hybrid_serves_the_snapshot_one_token_short(backend_name, folder):
    first = prompt(40, seed=1)
    # The same prompt again, an extension, and one that leaves the cached prompt at 30.
    prompts = [first, first, first + prompt(9, seed=2), first[:30] + prompt(9, seed=3)]
    off = await real_engine(backend_name, folder, **REUSE_OFF)
    want = [(await run(off, p, 10))[0] for p in prompts]
    await off.shutdown(1)
    engine = await real_engine(backend_name, folder, **ON)
    served = []
    for p, expected in zip(prompts, want):
        tokens, done = await run(engine, p, 10)
        assert tokens == expected and done.finish_reason in ("length", "stop")
        served.append((done.usage.reuse_source, done.usage.reused_tokens))
    # The snapshot holds [0, 39): the identical prompt and the extension are served there; the
    # prompt leaving it at 30 finds no state held at 30 or below, so nothing is offered or refused.
    assert served == [(None, 0), ("cache", 39), ("cache", 39), (None, 0)]
    assert engine.metrics.clone_refusals.get(source="cache", reason="recurrent_position") == 0
    await settled(engine, engine.backend)
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


async def test_a_burst_on_a_hybrid_gives_the_tokens_of_reuse_off(backend_name, folder):
    shared = prompt(64, seed=4)
    prompts = [shared + prompt(3 + i, seed=10 + i) for i in range(3)]
    off = await real_engine(backend_name, folder, **REUSE_OFF)
    want = [(await run(off, p, 10))[0] for p in prompts]
    await off.shutdown(1)
    engine = await real_engine(backend_name, folder, **ON)
    results = await asyncio.gather(*(run(engine, p, 10) for p in prompts))
    assert [tokens for tokens, _ in results] == want
    # The leader's chunk stops at the followers' target: the clone runs at its position.
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results[1:]] == [("donor", 64)] * 2
    await settled(engine, engine.backend)
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


async def test_a_named_session_on_a_hybrid_resumes_exactly(backend_name, folder):
    engine = await real_engine(backend_name, folder, **ON)
    first = prompt(30, seed=7)
    out, _ = await run(engine, first, 10, session_id="chat")
    follow_up = first + out + prompt(12, seed=8)
    warm, done = await run(engine, follow_up, 10, session_id="chat")
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("session", 39)
    await engine.shutdown(1)
    off = await real_engine(backend_name, folder, **REUSE_OFF)
    cold, _ = await run(off, follow_up, 10)
    assert warm == cold
    await off.shutdown(1)


async def test_a_prompt_sharing_a_running_conversation_to_a_message_end_clones_its_checkpoint(backend_name, folder):
    """The donor keeps its recurrent state where its messages end (GenerateRequest.boundaries); a recipient
    that shares its conversation up to the second one and goes its own way is cloned there, while the
    donor decodes on; the checkpoints are in the donor's reserved bytes."""
    conversation = prompt(64, seed=20)
    recipient = conversation[:48] + prompt(10, seed=21)
    want = await references(backend_name, folder, [conversation, recipient], 12, ignore_eos=True)
    # No prefix cache: its snapshot would take the checkpoints over (the next test).
    engine = await real_engine(backend_name, folder, **{**ON, "prefix_cache_entries": 0})
    backend = engine.backend
    gate = backend.gates["decode"] = Gate()
    asked = request(conversation, 12, rid="donor", boundaries=(24, 48), ignore_eos=True)
    assert engine.serving.admission.checkpoints(asked) == (24, 48)
    priced = engine.serving.admission.request_bytes(64, 12, checkpoints=2)
    assert priced == engine.serving.admission.request_bytes(64, 12) + 2 * engine.info.kv.state_bytes > 0
    donor = engine.submit(asked)
    await reached(gate)  # its prompt is in, checkpoints at 24 and 48 kept; held in its first decode
    taker = engine.submit(request(recipient, 12, rid="taker", ignore_eos=True))
    gate.open()
    (donor_tokens, _), (tokens, done) = await asyncio.gather(collect(donor), collect(taker))
    assert [donor_tokens, tokens] == want
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("donor", 48)
    await settled(engine, backend)
    await engine.shutdown(1)
    assert backend.live_sessions() == 0


async def test_followers_of_a_cancelled_leader_are_served_from_what_it_holds(backend_name, folder):
    """A leader held mid-prefill at 16 is followed by two requests: one to 20, which the leader's running
    chunk passes (its checkpoint at 18, a message end, serves it), one to 48, the heir when the leader is
    cancelled at 32 (its position). Both give the tokens of reuse off; nothing leaks."""
    leader_prompt = prompt(64, seed=30)
    short = leader_prompt[:20] + prompt(8, seed=31)
    long = leader_prompt[:48] + prompt(8, seed=32)
    want = await references(backend_name, folder, [short, long], 8, ignore_eos=True)
    engine = await real_engine(backend_name, folder, **{**ON, "prefix_cache_entries": 0})
    backend = engine.backend
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 16)
    leader = engine.submit(request(leader_prompt, 8, rid="leader", boundaries=(18,), ignore_eos=True))
    await reached(gate)
    handles = [engine.submit(request(p, 8, rid=f"f{i}", ignore_eos=True)) for i, p in enumerate((short, long))]
    assert {r.phase.order.target for r in engine.requests() if isinstance(r.phase, Following)} == {20, 48}
    leader.cancel()
    gate.open()
    results = await asyncio.gather(*(collect(h) for h in handles))
    assert (await collect(leader))[1].finish_reason == "cancelled"
    assert [tokens for tokens, _ in results] == want
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results] == [("donor", 18), ("donor", 32)]
    await settled(engine, backend)
    await engine.shutdown(1)
    assert backend.live_sessions() == 0


async def test_a_prompt_sharing_a_finished_conversation_to_a_message_end_is_served_from_the_cache(backend_name, folder):
    """A finished request's snapshot keeps its message-boundary checkpoints: a later prompt that shares the
    conversation up to one (and not beyond) is served there from the cache; nothing is left held."""
    conversation = prompt(64, seed=40)
    later = conversation[:48] + prompt(12, seed=41)
    want = await references(backend_name, folder, [conversation, later], 8, ignore_eos=True)
    engine = await real_engine(backend_name, folder, **ON)
    first, _ = await run(engine, conversation, 8, boundaries=(24, 48), ignore_eos=True)
    tokens, done = await run(engine, later, 8, ignore_eos=True)
    assert [first, tokens] == want
    assert (done.usage.reuse_source, done.usage.reused_tokens) == ("cache", 48)
    await settled(engine, engine.backend)
    held = engine.backend.total_bytes()
    assert held == engine.stats().cached_bytes  # the snapshots' bytes, checkpoints included, are the cache's
    await engine.shutdown(1)
    assert engine.backend.live_sessions() == 0


async def test_a_clone_now_at_a_running_donors_position_falls_back_when_the_donor_moved_on(backend_name, folder):
    """A recipient sharing exactly what a prefilling donor has committed is planned as a clone-now at the
    donor's position, its one clonable state. The runner finishes the donor's chunk in flight before it
    reads the recipient's Start, so the state at that position is gone: the clone is refused (nothing of
    the donor changes), and the recipient prefills from scratch, with the tokens of reuse off."""
    donor_prompt = prompt(64, seed=50)
    recipient = donor_prompt[:16] + prompt(10, seed=51)
    want = await references(backend_name, folder, [donor_prompt, recipient], 8, ignore_eos=True)
    engine = await real_engine(backend_name, folder, **{**ON, "prefix_cache_entries": 0})
    backend = engine.backend
    gate = backend.gates["prefill"] = Gate(lambda sessions, chunks: sessions[0].position == 16)
    donor = engine.submit(request(donor_prompt, 8, rid="donor", ignore_eos=True))
    await reached(gate)  # committed 16; the chunk to 32 is in flight
    taker = engine.submit(request(recipient, 8, rid="taker", ignore_eos=True))
    gate.open()
    (donor_tokens, _), (tokens, done) = await asyncio.gather(collect(donor), collect(taker))
    assert [donor_tokens, tokens] == want
    assert (done.usage.reuse_source, done.usage.reused_tokens) == (None, 0)
    assert engine.metrics.clone_refusals.get(source="donor", reason="recurrent_position") == 1
    await settled(engine, backend)
    await engine.shutdown(1)
    assert backend.live_sessions() == 0


async def test_checkpoints_moved_into_a_snapshot_leave_the_requests_hold(backend_name, folder):
    """A request's message-boundary checkpoints go with its prompt's snapshot into the prefix cache, which
    counts them from then on: the still-decoding request's hold lets their bytes go (never counted twice)."""
    engine = await real_engine(backend_name, folder, **ON)
    backend, adm = engine.backend, engine.serving.admission
    gate = backend.gates["decode"] = Gate()
    asked = request(prompt(64, seed=60), 8, rid="talker", boundaries=(24, 48), ignore_eos=True)
    handle = engine.submit(asked)
    await reached(gate)  # the prompt is in and captured; held in its first decode
    await until(lambda: engine.stats().cached == 1)
    talker = next(r for r in engine.requests() if r.req.request_id == "talker")
    assert engine.stats().cached_bytes == adm.clone_bytes(63) + 2 * engine.info.kv.state_bytes
    assert adm.holds(talker) == adm.request_bytes(64, 8, start=0)  # its checkpoints are the cache's now
    gate.open()
    await collect(handle)
    await settled(engine, backend)
    await engine.shutdown(1)
    assert backend.live_sessions() == 0
