"""Active reuse and following on the real backends (MLX and torch), each tiny architecture, float32:
a recipient served from a donor's state produces exactly the greedy tokens it would without reuse,
and the donor's own tokens are unchanged."""

import asyncio

from backend_fixtures import backend_name, prompt  # noqa: F401  (fixture: each importable backend)
from engine_harness import REUSE_OFF, collect, real_engine, references, request, run, settled
from scripted_backend import Gate
from kvfork.server.engine.matching import common_prefix


async def test_a_donor_clone_gives_the_tokens_of_a_fresh_prefill(backend_name, arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    donor_prompt = prompt(48, seed=1)
    recipients = [donor_prompt + prompt(6, seed=2)]  # extends the donor's prompt: every arch can serve it
    if arch != "gemma3":  # a shared prefix then a different tail: a decoding sliding-window donor has lost it
        recipients.append(donor_prompt[:40] + prompt(9, seed=3))
    want = await references(backend_name, folder, [donor_prompt] + recipients, 12)
    engine = await real_engine(backend_name, folder, prefix_cache_entries=0, active_prefix_reuse_min_tokens=8, follow=False)
    for recipient, expected in zip(recipients, want[1:]):
        gate = engine.backend.gates["decode"] = Gate()
        donor = engine.submit(request(donor_prompt, 12))
        await asyncio.to_thread(gate.reached.wait, 10)  # the donor's first decode: the loop saw its prompt done
        handle = engine.submit(request(recipient, 12))
        gate.open()
        (donor_tokens, _), (tokens, done) = await asyncio.gather(collect(donor), collect(handle))
        assert donor_tokens == want[0]
        assert tokens == expected
        assert done.usage.reuse_source == "donor"
        assert done.usage.reused_tokens == min(common_prefix(donor_prompt, recipient), len(recipient) - 1)
    await settled(engine, engine.backend)
    assert engine.backend.live_sessions() == 0
    await engine.shutdown(1)


async def test_a_burst_follows_its_leader_exactly(backend_name, arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    shared = prompt(64, seed=4)
    prompts = [shared + prompt(3 + i, seed=10 + i) for i in range(3)]
    want = await references(backend_name, folder, prompts, 10)
    engine = await real_engine(backend_name, folder, prefix_cache_entries=0, active_prefix_reuse_min_tokens=8)
    results = await asyncio.gather(*(run(engine, p, 10) for p in prompts))
    assert [tokens for tokens, _ in results] == want
    assert [(d.usage.reuse_source, d.usage.reused_tokens) for _, d in results[1:]] == [("donor", 64)] * 2
    assert engine.metrics.prefilled_tokens.get() == 64 + sum(3 + i for i in range(3))
    await settled(engine, engine.backend)
    assert engine.backend.live_sessions() == 0
    await engine.shutdown(1)
