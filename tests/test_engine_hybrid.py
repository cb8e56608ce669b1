"""The engine on a hybrid model (Qwen3.5: Gated DeltaNet beside full attention), both backends,
float32, reuse on at its defaults: every request gets exactly the greedy tokens of reuse off.
Matching does not know the recurrent rule yet, so clones it plans at other positions are refused
(base.clone_positions) and the engine falls back to a full prefill, with no error to the client."""

import asyncio

import numpy as np

from backend_fixtures import backend_name  # noqa: F401  (fixture: each importable backend)
from engine_harness import run, settled
from test_engine_real_reuse import OFF, engine_on


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


async def test_reuse_on_gives_the_tokens_of_reuse_off(backend_name, tiny_hybrid_dir):
    folder = tiny_hybrid_dir("qwen3_5")
    shared = prompt(48, seed=1)
    prompts = [shared, shared, shared + prompt(6, seed=2), shared[:40] + prompt(9, seed=3)]
    burst = [shared + prompt(3 + i, seed=10 + i) for i in range(3)]

    reference = await engine_on(backend_name, folder, **OFF)
    want = [(await run(reference, p, 10))[0] for p in prompts + burst]
    await reference.shutdown(1)

    engine = await engine_on(backend_name, folder)
    got = [(await run(engine, p, 10))[0] for p in prompts]  # one after another: the prefix cache
    got += [tokens for tokens, _ in await asyncio.gather(*(run(engine, p, 10) for p in burst))]  # together
    assert got == want
    await settled(engine, engine.backend)
    await engine.shutdown(1)
