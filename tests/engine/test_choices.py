"""n > 1 in the engine, on the scripted backend: one prefill, a clone per other choice at the prompt's
full length, admission of all choices together, faults that stay in their choice, cancels that free all."""

import asyncio

import pytest
from engine_harness import collect, prompt_of, reached, request, settled, start_engine, until
from scripted_backend import Gate, ScriptedBackend

from kvfork.backends.base import SamplingParams
from kvfork.server.engine.api import CapacityExhausted, InvalidRequest, choice_sampling

PROMPT = prompt_of(40)


def prefilled(backend) -> int:
    return sum(n for call in backend.calls if call[0] == "prefill" for _, n in call[1])


def clones_at(backend, upto: int) -> int:
    return sum(1 for call in backend.calls if call[0] == "clone" and call[2] == upto)


def test_choice_i_samples_with_seed_plus_i():
    base = SamplingParams(temperature=1.0, seed=41)
    assert choice_sampling(base, 0) is base
    assert [choice_sampling(base, i).seed for i in (1, 2)] == [42, 43]
    wrapped = SamplingParams(seed=-1)  # -1 draws the stream of 2**64 - 1: choice 1 wraps to 0
    assert choice_sampling(wrapped, 1).seed == 0
    assert choice_sampling(SamplingParams(), 3).seed is None


async def test_the_prompt_is_prefilled_once_and_each_other_choice_clones_it():
    backend = ScriptedBackend()
    engine = await start_engine(backend, prefix_cache_entries=0)
    handles = engine.submit_choices(request(PROMPT, 6, n=3))
    results = await asyncio.gather(*(collect(h) for h in handles))
    for tokens, done in results:  # scripted sampling is greedy: every choice makes the lone answer
        assert done.finish_reason == "length" and tokens == backend.greedy(PROMPT, 6)
    assert prefilled(backend) == len(PROMPT) and clones_at(backend, len(PROMPT)) == 2
    usages = [done.usage for _, done in results]
    assert [u.prompt_tokens for u in usages] == [len(PROMPT), 0, 0]  # the prompt counted once
    assert [u.prefilled_tokens for u in usages] == [len(PROMPT), 0, 0]
    assert [u.generated_tokens for u in usages] == [6, 6, 6]
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0 and engine.stats().slots_used == 0
    await engine.shutdown(1)


async def test_the_prompt_is_captured_once_and_reused_by_the_next_request():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    await asyncio.gather(*(collect(h) for h in engine.submit_choices(request(PROMPT, 4, n=2))))
    assert engine.stats().cached == 1
    tokens, done = await collect(engine.submit(request(PROMPT, 4)))
    assert done.usage.reused_tokens == len(PROMPT) - 1 and tokens == backend.greedy(PROMPT, 4)
    await engine.shutdown(1)


async def test_choices_are_admitted_together_with_every_byte_reserved():
    backend = ScriptedBackend()
    gate = backend.gates["prefill"] = Gate()
    engine = await start_engine(backend, inference_slots=3, prefix_cache_entries=0)
    blocker = engine.submit(request(prompt_of(10, start=300), 1, rid="blocker"))
    await reached(gate)
    handles = engine.submit_choices(request(PROMPT, 8, n=3))
    await asyncio.sleep(0.05)
    adm = engine.serving.admission
    stats = engine.stats()
    assert stats.slots_used == 1 and stats.queued == 1  # two slots free: three choices wait for three
    decoding = backend.gates["decode"] = Gate()  # the blocker makes one token: it never decodes
    gate.open()
    await collect(blocker)
    await reached(decoding)
    await until(lambda: all(r.committed for r in engine.requests()))
    # choice 0 opened its session empty; the others are clones at the prompt's full length
    choice = adm.choice_bytes(len(PROMPT), 8)
    assert choice == backend.info.kv.bytes_for(len(PROMPT) + 8, start=len(PROMPT))
    stats = engine.stats()
    assert stats.slots_used == 3 and stats.reserved == adm.request_bytes(len(PROMPT), 8, start=0) + 2 * choice
    decoding.open()
    await asyncio.gather(*(collect(h) for h in handles))
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().slots_used == 0
    await engine.shutdown(1)


async def test_more_choices_than_slots_or_in_a_named_session_are_refused():
    engine = await start_engine(ScriptedBackend(), inference_slots=2)
    with pytest.raises(CapacityExhausted):
        engine.submit_choices(request(PROMPT, 4, n=3))
    with pytest.raises(InvalidRequest):
        engine.submit_choices(request(PROMPT, 4, n=2, session_id="s"))
    assert engine.stats().reserved == 0 and not list(engine.requests())
    await engine.shutdown(1)


@pytest.mark.parametrize("at_output", [0, 3])  # its first token (from the shared row), or a decode step
async def test_a_failing_choice_fails_alone(at_output):
    backend = ScriptedBackend()
    seeded = SamplingParams(temperature=1.0, seed=42)
    backend.sample_fail = lambda state: state.params.seed == 43 and len(state.output) == at_output
    engine = await start_engine(backend, prefix_cache_entries=0)
    handles = engine.submit_choices(request(PROMPT, 6, n=3, sampling=seeded))
    results = await asyncio.gather(*(collect(h) for h in handles))
    for i, (tokens, done) in enumerate(results):
        if i == 1:
            assert done.finish_reason == "error" and "sampling failed" in done.error
            assert tokens == backend.greedy(PROMPT, at_output)
        else:
            assert done.finish_reason == "length" and tokens == backend.greedy(PROMPT, 6)
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)


async def test_a_refused_choice_clone_fails_that_choice_alone():
    backend = ScriptedBackend()
    backend.refuse = lambda session, upto: "scripted" if upto == len(PROMPT) else None
    engine = await start_engine(backend, prefix_cache_entries=0)
    results = await asyncio.gather(*(collect(h) for h in engine.submit_choices(request(PROMPT, 5, n=3))))
    assert results[0][1].finish_reason == "length" and results[0][0] == backend.greedy(PROMPT, 5)
    for tokens, done in results[1:]:
        assert done.finish_reason == "error" and "clone" in done.error and tokens == []
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)


@pytest.mark.parametrize("where", ["queued", "prefilling", "decoding"])
async def test_cancelling_every_choice_frees_everything(where):
    backend = ScriptedBackend()
    kind = "decode" if where == "decoding" else "prefill"
    gate = backend.gates[kind] = Gate()
    engine = await start_engine(backend, inference_slots=3)
    blocker = engine.submit(request(prompt_of(10, start=300), 1, rid="blocker")) if where == "queued" else None
    if blocker is not None:
        await reached(gate)
    handles = engine.submit_choices(request(PROMPT, 500, n=3))
    if blocker is None:
        await reached(gate)
    for handle in handles:  # a disconnect cancels every choice
        handle.cancel()
    gate.open()
    results = await asyncio.gather(*(collect(h) for h in handles))
    assert all(done.finish_reason == "cancelled" for _, done in results)
    if blocker is not None:
        await collect(blocker)
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().slots_used == 0 and not list(engine.requests())
    await engine.shutdown(1)


@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
async def test_on_a_real_backend_the_choices_never_hold_more_than_they_reserved(backend_name, tiny_model_dir):
    """Every step's report of what the backend holds stays within what admission reserved for the
    choices (torch prices a choice's clone exactly; MLX within its tolerance)."""
    from kvfork.backends import create_backend

    engine = await start_engine(create_backend(backend_name), tiny_model_dir("llama"), "float32",
                                prefix_cache_entries=0, max_tokens=40)
    kv = engine.info.kv
    over = []
    handles = engine.submit_choices(request(prompt_of(300), 40, n=3, ignore_eos=True))

    async def watch() -> None:
        while any(h.done is None for h in handles):
            stats = engine.stats()
            if stats.slots_used == 3:
                over.append(stats.total_bytes - stats.reserved)
            await asyncio.sleep(0.001)  # each step's report lands between two reads

    watcher = asyncio.create_task(watch())
    results = await asyncio.gather(*(collect(h) for h in handles))
    await watcher
    assert [len(tokens) for tokens, _ in results] == [40] * 3
    assert len({tuple(tokens) for tokens, _ in results}) == 1  # greedy: the same answer three times
    slack = kv.tolerance * engine.stats().reserved
    assert over and max(over) <= slack
    await settled(engine, engine.backend)
    assert engine.stats().reserved == 0
    await engine.shutdown(1)


async def test_active_reuse_serves_choices_and_is_served_by_their_prompt():
    shared = prompt_of(60, start=11)
    donor_prompt, choices_prompt, later_prompt = shared + [7] * 5, shared + [9] * 6, shared + [9] * 6 + [4] * 3
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend, active_prefix_reuse_min_tokens=8, follow=False, prefix_cache_entries=0,
                                prefill_chunk=16)
    donor = engine.submit(request(donor_prompt, 200))
    await anext(donor)
    # n choices clone the running donor's shared prefix, then prefill only their own tail, once
    handles = engine.submit_choices(request(choices_prompt, 200, n=2))
    await anext(handles[1])
    later, done = await collect(engine.submit(request(later_prompt, 4)))  # and their prompt serves a later one
    assert later == backend.greedy(later_prompt, 4) and done.usage.reuse_source == "donor"
    assert done.usage.reused_tokens >= len(choices_prompt) - 1
    results = await asyncio.gather(*(collect(h) for h in handles))
    first = results[0][1].usage
    assert (first.reuse_source, first.reused_tokens, first.prefilled_tokens) == ("donor", 60, 6)
    alone = backend.greedy(choices_prompt, 200)
    assert results[0][0] == alone and results[1][0] == alone[1:]  # choice 1's first token was read above
    await collect(donor)
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)


async def test_choices_whose_donor_clone_is_refused_go_to_the_runner_with_the_next_start():
    """n choices may start from a running donor's clone (clone-now); when the runner refuses it, the
    request takes the normal path, and its other choices go with that second Start (the runner
    dropped them with the first)."""
    backend = ScriptedBackend()
    backend.delay["decode"] = 0.001
    engine = await start_engine(backend, active_prefix_reuse_min_tokens=8, follow=False, prefix_cache_entries=0)
    donor = engine.submit(request(PROMPT + [7] * 5, 10_000))
    await asyncio.wait_for(donor.__anext__(), 10)  # decoding: its whole prompt is committed
    backend.refuse = lambda session, upto: "no_memory" if upto == len(PROMPT) else None  # the donor clone only
    prompt = PROMPT + [9] * 6
    results = await asyncio.gather(*(collect(h) for h in engine.submit_choices(request(prompt, 4, n=2))))
    assert [(tokens, done.finish_reason) for tokens, done in results] == [(backend.greedy(prompt, 4), "length")] * 2
    assert engine.metrics.clone_refusals.get(source="donor", reason="no_memory") == 1
    donor.cancel()
    await collect(donor)
    await settled(engine, backend)
    assert engine.stats().reserved == 0 and engine.stats().slots_used == 0
    await engine.shutdown(1)
