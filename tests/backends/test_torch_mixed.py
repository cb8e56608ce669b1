"""The torch backend's one forward pass per call: decode rows and prefill chunks of several
sessions in one varlen batch give what each session alone gives, and a failed pass reports
each row honestly (base.BatchFailed)."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from backend_fixtures import assert_close, lent, load
from kvfork.backends.base import BatchFailed, RowState
from kvfork.backends.torch.backend import TorchBackend
from engine_harness import run
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.watch.metrics import Registry
from tiny_hybrid_models import HYBRID_ARCHS
from tolerance import Kind

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")
CHUNK = 13  # the prefilling session's chunk: crosses gemma3's 16-token window within a few steps


@pytest.fixture(params=["llama", "qwen3", "gemma3", *HYBRID_ARCHS])
def backend(request, tiny_model_dir, tiny_hybrid_dir) -> TorchBackend:
    """A loaded float32 backend (backend_fixtures.lent)."""
    folder = (tiny_hybrid_dir if request.param in HYBRID_ARCHS else tiny_model_dir)(request.param)
    yield from lent(request, ("torch", request.param, DEVICE), lambda: load(TorchBackend(DEVICE), folder))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


class Passes:
    """Counts the model's forward passes."""

    def __init__(self, b: TorchBackend):
        self.n = 0
        self.handle = b.model.register_forward_hook(self._count)

    def _count(self, *_):
        self.n += 1


def decode_alone(b: TorchBackend, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logits, the session alone in every call."""
    s = b.open_session()
    logits = [b.to_numpy(b.prefill([s], [prompt]))[0]]
    picks = []
    for _ in range(steps):
        picks.append(int(logits[-1].argmax()))
        logits.append(b.to_numpy(b.decode([s], [picks[-1]]))[0])
    b.release(s)
    return picks, logits


def prefill_alone(b: TorchBackend, prompt: list[int], chunk: int = CHUNK) -> list[np.ndarray]:
    """Each chunk's last-token logits, the session alone in every call."""
    s = b.open_session()
    out = [b.to_numpy(b.prefill([s], [prompt[at : at + chunk]]))[0] for at in range(0, len(prompt), chunk)]
    b.release(s)
    return out


@pytest.mark.numeric
def test_a_mixed_step_equals_each_session_alone_in_one_pass(backend):
    steps = 5
    prompts = [tokens(1, 40), tokens(2, 7)]  # two decoders at different lengths (one past the window)
    filling = tokens(3, CHUNK * steps)  # a third session prefills while they decode
    alone = [decode_alone(backend, p, steps) for p in prompts]
    chunks_alone = prefill_alone(backend, filling)

    passes = Passes(backend)
    decoders, filler = [backend.open_session() for _ in prompts], backend.open_session()
    first = backend.to_numpy(backend.prefill(decoders, prompts))  # rows of different lengths, one pass
    assert passes.n == 1
    for row, prompt, (_, logits) in zip(first, prompts, alone):
        assert_close(backend, row, logits[0], Kind.BATCHED, context=len(prompt))
    last = list(first)
    for step in range(steps):
        picks = [int(row.argmax()) for row in last]
        assert picks == [picked[step] for picked, _ in alone]
        chunk = filling[step * CHUNK : (step + 1) * CHUNK]
        before = passes.n
        out = backend.to_numpy(backend.prefill([*decoders, filler], [[p] for p in picks] + [chunk]))
        assert passes.n == before + 1  # decode rows and a prefill chunk: exactly one forward pass
        for row, prompt, (_, logits) in zip(out, prompts, alone):
            assert_close(backend, row, logits[step + 1], Kind.BATCHED, context=len(prompt) + step + 1)
        assert_close(backend, out[-1], chunks_alone[step], Kind.BATCHED, context=(step + 1) * CHUNK)
        last = out[:-1]
    assert [s.position for s in decoders] == [len(p) + steps for p in prompts]
    passes.handle.remove()
    for s in [*decoders, filler]:
        backend.release(s)


@pytest.mark.numeric
def test_a_failed_pass_reports_each_row_and_a_retry_is_exact(backend):
    """A failure inside the pass: rows whose rings or recurrent states were written are CORRUPT,
    the others UNTOUCHED, at their old position; running an untouched row again gives its true logits."""
    prompts = [tokens(4, 30), tokens(5, 9)]
    sessions = [backend.open_session() for _ in prompts]
    backend.prefill(sessions, prompts)
    rows = [[11], tokens(6, 20)]  # a decode row and a prefill chunk

    def boom(*_):
        raise RuntimeError("injected")

    handle = backend.model.model.layers[-1].register_forward_hook(boom)
    with pytest.raises(BatchFailed) as failed:
        backend.prefill(sessions, rows)
    handle.remove()
    in_place = any(layer.kind in ("sliding", "recurrent") for layer in backend.info.layers)
    assert failed.value.rows == [RowState.CORRUPT if in_place else RowState.UNTOUCHED] * 2
    assert [s.position for s in sessions] == [len(p) for p in prompts]
    if not in_place:
        again = backend.to_numpy(backend.prefill(sessions, rows))
        for row, prompt, written in zip(again, prompts, rows):
            assert_close(backend, row, prefill_alone(backend, prompt + written, len(prompt + written))[0],
                         Kind.BATCHED, context=len(prompt + written))
    for s in sessions:
        backend.release(s)


async def test_the_engine_runs_one_forward_pass_per_step(tiny_model_dir):
    """One request decodes while another prefills in chunks: every runner step is exactly one
    model forward pass on torch, and both requests get the tokens they get alone."""
    registry = Registry()
    config = EngineConfig(prefill_chunk=8, prefix_cache_entries=0, kv_budget_bytes=1 << 30, max_tokens=30)
    engine = Engine(TorchBackend(DEVICE), tiny_model_dir("llama"), "float32", config, registry)
    await engine.start()
    prompts = [tokens(7, 8), tokens(8, 80)]
    alone = [await run(engine, p, 30) for p in prompts]
    passes, steps_before = Passes(engine.backend), steps_total(registry)
    together = await asyncio.gather(*(run(engine, p, 30) for p in prompts))
    passes.handle.remove()
    assert [out for out, _ in together] == [out for out, _ in alone]
    steps = steps_total(registry) - steps_before
    assert passes.n == steps
    assert steps < 30 + 30 + 80 // 8  # decode rows rode along with prefill chunks
    await engine.shutdown(1)


def steps_total(registry) -> float:
    line = next(line for line in registry.render().splitlines() if line.startswith("kvfork_runner_steps_total"))
    return float(line.split()[-1])
