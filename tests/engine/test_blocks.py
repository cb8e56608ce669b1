"""Clone by reference through the engine (torch, --clone-mode share): requests sharing a long prefix
give the greedy tokens of reuse off, each block is counted once in the budget, the budget's view equals
what the backend holds, and nothing is left once they are gone."""

import asyncio

import pytest

from backend_fixtures import prompt
from kvfork.backends.torch import kv
from kvfork.backends.torch.backend import TorchBackend
from engine_harness import collect, real_engine, references, request, run, settled, until
from kvfork.server.engine.api import CapacityExhausted
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.engine.loop.request import Following, Phase

SHARED = 600  # two whole blocks and part of a third


async def engine_on(folder: str, **config) -> Engine:
    """The torch backend on the CPU, in 64-token prefill chunks."""
    return await real_engine(TorchBackend("cpu"), folder, **{"prefill_chunk": 64, **config})


async def torch_references(folder: str, prompts, max_tokens: int) -> list[list[int]]:
    return await references(TorchBackend("cpu"), folder, prompts, max_tokens, prefill_chunk=64)


def watch_blocks(backend: TorchBackend, seen: list[int]) -> None:
    """After each forward pass (on the runner thread), how many blocks have more than one holder: every
    step is seen, however fast the machine (a loop polling on a timer may miss a short-lived share)."""
    def watched(call):
        def forward(*args):
            out = call(*args)
            seen.append(backend.block_stats().shared)
            return out
        return forward

    for name in ("prefill", "decode"):
        setattr(backend, name, watched(getattr(backend, name)))


def phase_of(engine: Engine, handle) -> Phase | None:
    r = next((x for x in engine.requests() if x.handle is handle), None)
    return r.phase if r is not None else None


def committed(engine: Engine, handle) -> int:
    r = next((x for x in engine.requests() if x.handle is handle), None)
    return r.committed if r is not None else 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
async def test_requests_sharing_a_long_prefix_hold_it_once_and_answer_as_reuse_off(arch, tiny_model_dir):
    """A leader, followers parked behind it (one cancelled while parked), the leader cancelled
    mid-prefill (its heir is handed what it committed), a request served from the prefix cache, a named
    session resumed: every completed answer equals reuse off, blocks were shared, the budget's view
    equals the backend's bytes once settled, and shutdown leaves no block."""
    folder = tiny_model_dir(arch)
    shared = prompt(SHARED, seed=1)
    prompts = [shared + prompt(4 + i, seed=10 + i) for i in range(4)]
    named = shared + prompt(7, seed=20)
    want = await torch_references(folder, prompts + [named], 8)
    resumed = named + want[4] + [9, 8, 7]  # extends what the named session holds: its prompt and its answer
    want += await torch_references(folder, [resumed], 8)
    engine = await engine_on(folder, prefix_cache_entries=4, active_prefix_reuse_min_tokens=8)
    backend = engine.backend
    seen: list[int] = []
    watch_blocks(backend, seen)

    # a leader that will be cancelled mid-prefill, and followers behind it
    leader = engine.submit(request(prompts[0], 8))
    await until(lambda: committed(engine, leader) > 0)
    heir, parked = engine.submit(request(prompts[1], 8)), engine.submit(request(prompts[2], 8))
    await until(lambda: isinstance(phase_of(engine, parked), Following) and isinstance(phase_of(engine, heir), Following))
    parked.cancel()
    await until(lambda: committed(engine, leader) >= 3 * 64 + 1)
    leader.cancel()
    (_, gone), (heir_tokens, heir_done), (_, parked_done) = await asyncio.gather(
        collect(leader), collect(heir), collect(parked))
    assert gone.finish_reason == "cancelled" and parked_done.finish_reason == "cancelled"
    assert heir_tokens == want[1] and heir_done.usage.reuse_source == "donor"

    # a burst behind a leader that runs to its end, then the prefix cache, then a named session twice
    results = await asyncio.gather(run(engine, prompts[3], 8), run(engine, prompts[0], 8))
    assert [tokens for tokens, _ in results] == [want[3], want[0]]
    cached, done = await run(engine, prompts[3], 8)  # the same prompt again: every arch serves it from the cache
    assert cached == want[3] and done.usage.reuse_source == "cache"
    first, _ = await run(engine, named, 8, session_id="a")
    again, done = await run(engine, resumed, 8, session_id="a")
    assert (first, again) == (want[4], want[5]) and done.usage.reuse_source == "session"
    assert max(seen) >= 2, "no block was ever shared"

    await settled(engine, backend)
    stats = engine.stats()
    assert stats.reserved == 0 and not stats.in_transit
    assert stats.held == backend.total_bytes()
    assert engine.metrics.budget_exceeded.get() == 0
    await engine.shutdown(1)
    assert backend.live_sessions() == 0 and not backend.pool.stores and backend.total_bytes() == 0


@pytest.mark.parametrize("mode", ["share", "copy"])
async def test_n_choices_over_one_prefix_reserve_it_once(mode, tiny_model_dir):
    """N choices over a P-token prompt reserve P and each one's own tokens, not N x P: a budget that
    holds that is enough where clones share, and turns the request away where they copy."""
    folder = tiny_model_dir("llama")
    probe = TorchBackend("cpu")
    probe.set_clone_mode("share")
    cost = probe.load(folder, "float32").kv
    n, p, max_tokens = 4, 700, 20
    total = p + max_tokens
    shared_budget = cost.bytes_for(total) + (n - 1) * cost.bytes_for(total, shared=kv.floor_block(p), start=p)
    copied_budget = n * cost.bytes_for(total)
    assert shared_budget <= copied_budget / 2
    engine = await engine_on(folder, kv_budget_bytes=shared_budget, prefix_cache_entries=0, clone_mode=mode,
                             max_context=2048)
    text = prompt(p, seed=3)
    if mode == "copy":
        with pytest.raises(CapacityExhausted):
            engine.submit_choices(request(text, max_tokens, n=n))
    else:
        results = await asyncio.gather(*(collect(h) for h in engine.submit_choices(request(text, max_tokens, n=n))))
        assert all(done.finish_reason == "length" for _, done in results)
        want = await torch_references(folder, [text], max_tokens)
        assert all(tokens == want[0] for tokens, _ in results)  # greedy: every choice is the lone answer
        assert engine.metrics.budget_exceeded.get() == 0
    await engine.shutdown(1)


async def test_a_tight_budget_keeps_the_cached_prompts_it_holds(tiny_model_dir):
    """A cached prompt is mostly its request's store, read by reference (pooled once the request ended),
    and a short tail of its own: making room for a request counts both, so under a budget holding three
    cached prompts the fourth prompt evicts only the least recently used one (counting its own bytes
    alone evicted them all), and returning to the second is a cache hit."""
    folder = tiny_model_dir("llama")
    probe = TorchBackend("cpu")
    probe.set_clone_mode("share")
    cost = probe.load(folder, "float32").kv
    p, max_tokens = 300, 4
    store, tail = cost.positions(p), cost.positions(p, start=p) - kv.floor_block(p)  # 512 and 256 positions
    budget = (3 * (store + tail) + 1) * cost.full_bytes_per_token  # three cached, or two beside a request
    engine = await engine_on(folder, kv_budget_bytes=budget, clone_mode="share", max_context=1024, queue_timeout=60)
    prompts = [prompt(p, seed=20 + i) for i in range(4)]
    for text in prompts:
        await run(engine, text, max_tokens)
        await settled(engine, engine.backend)
    assert engine.stats().cached == 3
    _, done = await run(engine, prompts[1], max_tokens)
    assert done.usage.reused_tokens == p - 1
    await settled(engine, engine.backend)
    assert engine.metrics.budget_exceeded.get() == 0
    await engine.shutdown(1)
