"""The budget on the real backends: the cost function published at load (`ModelInfo.kv`) against what
the backend allocates. Exact on torch; on MLX within `kv.tolerance` (mlx-lm grows caches by the step of
each write, a ring holds a prefill chunk past its window, and the decode batch pads rows on the left)."""

import asyncio
import json

import numpy as np
import pytest

from backend_fixtures import backend, backend_name  # noqa: F401  (fixtures)
from kvfork.backends import create_backend
from kvfork.backends.model_info import FALLBACK_CONTEXT, ModelFacts, read_model_facts
from engine_harness import run, settled, start_engine
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.watch.metrics import Registry
from tiny_models import write_model


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 512, n).tolist()


def test_a_torch_session_costs_exactly_its_price(backend, backend_name):
    """Full layers in whole blocks of kv.BLOCK_TOKENS with one slot always free (a session of n tokens,
    opened, cloned or grown, holds round_up(n + 1), less the whole blocks a clone reads by reference),
    one ring of the window per sliding layer: to the byte, at the block edges too."""
    if backend_name != "torch":
        pytest.skip("MLX allocates approximately; its tolerance is tested through the engine below")
    b, kv = backend, backend.info.kv
    before = b.total_bytes()
    p = prompt(600, seed=1)
    s = b.open_session()
    assert b.session_bytes(s) == kv.bytes_for(0)
    for end in (10, 255, 256, 300, 511, 520):
        b.prefill([s], [p[s.position:end]])
        assert b.session_bytes(s) == kv.bytes_for(end)
    t = b.open_session()
    b.prefill([t], [p[:40]])
    for _ in range(5):
        b.decode([s, t], [5, 6])
    clone = b.clone(s, s.position)
    start = clone.position
    assert b.session_bytes(clone) == kv.bytes_for(start, shared=kv.shared(start), start=start)
    b.prefill([clone], [p[:300]])  # grows past its room
    assert b.session_bytes(clone) == kv.bytes_for(clone.position, shared=kv.shared(start), start=start)
    short = b.clone(t, 45)
    assert b.session_bytes(short) == kv.bytes_for(45, start=45)
    u = b.open_session()
    b.prefill([u], [p[:256]])
    edge = b.clone(u, 256)  # a whole block written: the clone holds the next one too
    assert b.session_bytes(edge) == kv.bytes_for(256, shared=kv.shared(256), start=256) > 0
    sessions = [(s, 0), (t, 0), (clone, start), (short, 45), (u, 0), (edge, 256)]
    assert b.total_bytes() == before + sum(kv.bytes_for(x.position, shared=kv.shared(at), start=at)
                                           for x, at in sessions)
    for x, _ in sessions:
        b.release(x)


async def test_after_a_run_the_budget_holds_what_the_backend_holds(backend_name, arch, tiny_model_dir):
    engine = await start_engine(create_backend(backend_name), tiny_model_dir(arch), "float32", max_tokens=16,
                                prefill_chunk=64)
    backend, kv = engine.backend, engine.info.kv
    prompts = [prompt(40 + 90 * i, seed=i) for i in range(3)]  # some longer than a growth step
    await asyncio.gather(*(run(engine, p, 12) for p in prompts), run(engine, prompt(270, seed=9), 12, session_id="a"),
                         run(engine, prompt(30, seed=8), 12, session_id="b"))
    await run(engine, prompts[0] + [5, 6], 4)  # served from the cache
    await settled(engine, backend)
    held, holds = engine.stats().held, backend.total_bytes()
    assert engine.stats().reserved == 0 and engine.stats().cached >= 3 and engine.stats().named_holding == 2
    if kv.tolerance == 0:
        assert held == holds
    else:
        assert abs(held - holds) <= kv.tolerance * holds
    assert engine.metrics.budget_exceeded.get() == 0
    await engine.shutdown(1)


def test_one_folder_gives_the_same_eos_and_context_on_both_backends(tmp_path, backend_name):
    """No context in config.json, EOS ids from config, generation_config and the tokenizer."""
    folder = write_model(tmp_path / "m", "llama")
    for name, edit in (("config.json", lambda c: c.pop("max_position_embeddings")),
                       ("tokenizer_config.json", lambda c: (c.pop("model_max_length"), c.update(eos_token="<|endoftext|>")))):
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 7], "temperature": 0.6}')
    facts = read_model_facts(folder)
    # config's <|im_end|>, generation_config's 7, the tokenizer's <|endoftext|>
    assert facts == ModelFacts((2, 7, 0), FALLBACK_CONTEXT, {"temperature": 0.6}, 512)
    info = create_backend(backend_name).load(str(folder), "float32")
    # the vocabulary a request's ids are checked against before the model loads is its logits' width
    assert (info.context_length, info.eos_token_ids, info.vocab_size) == (FALLBACK_CONTEXT, (2, 7, 0), 512)


async def test_sessions_decoding_together_stay_inside_the_budget(backend_name, tiny_model_dir):
    """MLX pads the rows of its decode batch to the longest: a short request decoding beside a long one
    holds as much as the long one. The budget holds that padding (KVCost.padded_rows), so two requests
    whose own sessions fit together, but whose padded rows do not, run one after the other."""
    from kvfork.tools.faulty_backend import FaultyBackend

    long_prompt, short_prompt = prompt(500, seed=7), prompt(10, seed=8)
    probe = create_backend(backend_name)
    kv = probe.load(tiny_model_dir("llama"), "float32").kv
    budget = (kv.bytes_for(500 + 8, start=499) + kv.bytes_for(10 + 60, start=9))  # both own sessions, no more
    watched = FaultyBackend(create_backend(backend_name), seed=0, rate=0.0, budget_bytes=budget)
    config = EngineConfig(kv_budget_bytes=budget, prefix_cache_entries=0, inference_slots=2, prefill_chunk=64,
                          active_prefix_reuse_min_tokens=0)
    engine = Engine(watched, tiny_model_dir("llama"), "float32", config, Registry())
    await engine.start()
    (_, long_done), (_, short_done) = await asyncio.gather(run(engine, long_prompt, 8), run(engine, short_prompt, 60))
    assert long_done.finish_reason == "length" and short_done.finish_reason == "length"
    assert watched.watch.over_budget == 0, f"peak {watched.watch.peak_bytes} of {budget}"
    await engine.shutdown(1)
