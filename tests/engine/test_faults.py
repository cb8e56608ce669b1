"""Faults stay where they start (runner.py's design rules), on the scripted backend.

The scripted backend's next token hashes the whole committed sequence, so a token
committed twice, or a session that goes on after a corrupt write, shows up as
tokens that differ from a lone run.
"""

import asyncio

from engine_harness import collect, prompt_of, reached, request, run, settled, start_engine
from scripted_backend import Gate, ScriptedBackend

from kvfork.backends.base import RowState

PROMPTS = [prompt_of(10, start=20 + 37 * i) for i in range(4)]


async def batched(engine, backend, prompts, max_tokens: int = 6):
    """Start `prompts` together: a blocker holds the runner until all are queued, so they are
    prefilled in one call and decode in the same steps."""
    blocker = prompt_of(10, start=400)
    gate = backend.gates["prefill"] = Gate()
    first = engine.submit(request(blocker, 1, rid="blocker"))
    await reached(gate)
    handles = [engine.submit(request(p, max_tokens, rid=f"r{i}")) for i, p in enumerate(prompts)]
    await asyncio.sleep(0.05)  # the control loop admits them while the runner is held
    gate.open()
    await collect(first)
    return await asyncio.gather(*(collect(h) for h in handles))


def sessions_of(backend, prompt) -> set[int]:
    return {s.id for s in backend._open.values() if s.tokens[:len(prompt)] == prompt}


def called_together(backend, kind: str, n: int) -> bool:
    return any(c[0] == kind and len(c[1]) == n for c in backend.calls)


async def test_a_sample_failure_in_a_decode_batch_fails_only_its_request():
    backend = ScriptedBackend()
    bad = PROMPTS[1]
    backend.sample_fail = lambda state: list(state.prompt) == bad and len(state.output) == 3
    engine = await start_engine(backend, prefix_cache_entries=0)
    results = await batched(engine, backend, PROMPTS)
    assert called_together(backend, "decode", 4)
    for prompt, (tokens, done) in zip(PROMPTS, results):
        if prompt is bad:
            assert done.finish_reason == "error" and "sampling failed" in done.error
            assert tokens == backend.greedy(bad, 3)
        else:  # committed once per token: exactly what each makes alone
            assert done.finish_reason == "length" and tokens == backend.greedy(prompt, 6)
    decodes = [c for c in backend.calls if c[0] == "decode"]
    assert all(len(set(ids)) == len(ids) for _, ids in decodes)
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)


async def test_a_sample_failure_on_the_last_prefill_step_fails_only_its_request():
    backend = ScriptedBackend()
    bad = PROMPTS[2]
    backend.sample_fail = lambda state: list(state.prompt) == bad
    engine = await start_engine(backend, prefix_cache_entries=0)
    results = await batched(engine, backend, PROMPTS[:3])
    assert called_together(backend, "prefill", 3)
    for prompt, (tokens, done) in zip(PROMPTS, results):
        if prompt is bad:
            assert done.finish_reason == "error" and tokens == []
        else:
            assert done.finish_reason == "length" and tokens == backend.greedy(prompt, 6)
    assert sum(1 for c in backend.calls if c[0] == "prefill" and len(c[1]) == 3) == 1  # never run again
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


def mixed_fault(backend, states: dict[int, RowState]):
    """One decode of all three requests fails with these row states (by prompt index)."""
    fired = []

    def fail(kind, sessions, inputs):
        if kind != "decode" or len(sessions) != 3 or fired or any(s.position < 13 for s in sessions):
            return False
        fired.append(True)
        index = [next(i for i, p in enumerate(PROMPTS) if s.tokens[:len(p)] == p) for s in sessions]
        return [states[i] for i in index]
    return fail


async def test_a_forward_failure_retries_untouched_keeps_committed_and_fails_corrupt():
    backend = ScriptedBackend()
    backend.fail = mixed_fault(backend, {0: RowState.UNTOUCHED, 1: RowState.CORRUPT, 2: RowState.COMMITTED})
    engine = await start_engine(backend, prefix_cache_entries=0)
    results = await batched(engine, backend, PROMPTS[:3], max_tokens=8)
    (tokens0, done0), (tokens1, done1), (tokens2, done2) = results
    assert done0.finish_reason == "length" and tokens0 == backend.greedy(PROMPTS[0], 8)  # retried
    assert done2.finish_reason == "length" and tokens2 == backend.greedy(PROMPTS[2], 8)  # went on from its logits
    assert done1.finish_reason == "error" and "partly written" in done1.error
    assert tokens1 == backend.greedy(PROMPTS[1], len(tokens1)) and len(tokens1) < 8
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)


async def test_a_committed_row_without_the_logits_it_needs_fails():
    backend = ScriptedBackend()
    backend.fail = mixed_fault(backend, {0: RowState.UNTOUCHED, 1: RowState.COMMITTED, 2: RowState.COMMITTED})
    backend.withhold_logits = True
    engine = await start_engine(backend, prefix_cache_entries=0)
    (tokens0, done0), (_, done1), (_, done2) = await batched(engine, backend, PROMPTS[:3], max_tokens=8)
    assert done0.finish_reason == "length" and tokens0 == backend.greedy(PROMPTS[0], 8)
    assert done1.finish_reason == done2.finish_reason == "error" and "without their logits" in done1.error
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_an_unexplained_backend_exception_fails_every_request_of_the_call():
    backend = ScriptedBackend()
    backend.fail = lambda kind, sessions, inputs: kind == "decode" and len(sessions) == 3 and RuntimeError("bug")
    engine = await start_engine(backend, prefix_cache_entries=0)
    results = await batched(engine, backend, PROMPTS[:3])
    assert all(done.finish_reason == "error" and "state lost" in done.error for _, done in results)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_a_refused_input_is_found_row_by_row_before_anything_changed():
    backend = ScriptedBackend()
    bad = PROMPTS[0]

    def fail(kind, sessions, inputs):
        if kind == "prefill" and any(s.position == 0 and list(c) == bad for s, c in zip(sessions, inputs)):
            return ValueError("a refused chunk")
        return False
    backend.fail = fail
    engine = await start_engine(backend, prefix_cache_entries=0)
    results = await batched(engine, backend, PROMPTS[:3])
    assert results[0][1].finish_reason == "error" and "refused" in results[0][1].error
    for prompt, (tokens, done) in zip(PROMPTS[1:3], results[1:]):
        assert done.finish_reason == "length" and tokens == backend.greedy(prompt, 6)
    await settled(engine, backend)
    assert backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_a_capture_that_runs_out_of_memory_leaves_the_request_whole():
    backend = ScriptedBackend()
    backend.fail = lambda kind, sessions, inputs: MemoryError("out of memory") if kind == "clone" else False
    engine = await start_engine(backend)
    prompt = prompt_of(40)
    tokens, done = await run(engine, prompt, 6)
    assert done.finish_reason == "length" and tokens == backend.greedy(prompt, 6)
    assert engine.stats().cached == 0
    assert engine.metrics.captures.get(outcome="failed") == 1
    await settled(engine, backend)
    assert backend.live_sessions() == 0 and engine.stats().reserved == 0
    await engine.shutdown(1)


async def test_a_cache_clone_that_raises_falls_back_to_a_cold_start():
    backend = ScriptedBackend()
    engine = await start_engine(backend)
    prompt = prompt_of(40)
    await run(engine, prompt, 6)
    assert engine.stats().cached == 1
    backend.fail = lambda kind, sessions, inputs: MemoryError("out of memory") if kind == "clone" else False
    tokens, done = await run(engine, prompt + [5, 6, 7], 6)
    assert done.finish_reason == "length" and tokens == backend.greedy(prompt + [5, 6, 7], 6)
    assert done.usage.reused_tokens == 0 and done.usage.prefilled_tokens == 43
    assert engine.metrics.clone_refusals.get(source="cache", reason="error") == 1
    await settled(engine, backend)
    await engine.shutdown(1)
