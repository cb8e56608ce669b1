"""The fault contract of batched calls (base.BatchFailed), on every backend and test architecture:
a forward pass that fails says per session what it did, and a session it calls UNTOUCHED
gives, run again, exactly what it would have given."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import numpy as np
import pytest
from backend_fixtures import assert_close, backend, backend_name, fresh, logits_np, prompt, release_all  # noqa: F401
from tolerance import Kind

from kvfork.backends.base import BatchFailed, RowState, SamplerState, SamplingParams

PREFIX = 20  # past the sliding window (16) of the gemma3 test model: its rings have wrapped


@contextmanager
def failing_layer(b, backend_name: str, index: int, on_call):
    """Layer `index` raises, before it runs, on its `on_call`-th call (1-based) while inside, or
    when `on_call(args)` says so."""
    if backend_name == "torch":
        import torch.nn as nn
        layers, base = b.model.model.layers, nn.Module
    else:
        import mlx.nn as nn
        layers, base = b.model.layers, nn.Module
    inner, calls = layers[index], []

    class Failing(base):
        def __call__(self, *args, **kwargs):
            calls.append(True)
            if on_call(args) if callable(on_call) else len(calls) == on_call:
                raise MemoryError("injected")
            return inner(*args, **kwargs)

        def __getattr__(self, name):  # the model reads the layer's settings (mlx-lm: use_sliding)
            return getattr(inner, name)

    layers[index] = Failing()
    try:
        yield
    finally:
        layers[index] = inner


def first_layer_writes(b, backend_name: str) -> bool:
    """Whether a failure at layer 1 leaves a session's state changed: MLX caches move their offsets
    (always); torch writes past `position` in a growing buffer invisibly, but a ring write is not."""
    return backend_name == "mlx" or b.info.layers[0].kind == "sliding"


def sessions_at_prefix(b, n: int):
    return [fresh(b, prompt(PREFIX, seed=10 + i))[0] for i in range(n)]


def reference(b, i: int, extra: list[int]) -> np.ndarray:
    s, logits = fresh(b, prompt(PREFIX, seed=10 + i) + extra)
    out = logits_np(b, logits)
    b.release(s)
    return out


@pytest.mark.numeric
def test_a_failed_prefill_reports_committed_failed_and_untouched_sessions(backend, backend_name):
    """MLX prefills session by session: a failure in the second leaves the first COMMITTED (with
    its logits), the third UNTOUCHED. torch runs all rows in one pass (mixed_batches): a failure
    in it commits none, and leaves each UNTOUCHED or CORRUPT alike."""
    b = backend
    sessions = sessions_at_prefix(b, 3)
    chunks = [prompt(6, seed=30 + i) for i in range(3)]
    with failing_layer(b, backend_name, 1, on_call=1 if b.mixed_batches else 2), \
            pytest.raises(BatchFailed) as failed:
        b.prefill(sessions, chunks)
    failed_row = RowState.CORRUPT if first_layer_writes(b, backend_name) else RowState.UNTOUCHED
    if b.mixed_batches:
        assert failed.value.rows == [failed_row] * 3
        assert [s.position for s in sessions] == [PREFIX] * 3
    else:
        assert failed.value.rows == [RowState.COMMITTED, failed_row, RowState.UNTOUCHED]
        assert [s.position for s in sessions] == [PREFIX + 6, PREFIX, PREFIX]
        assert_close(b, logits_np(b, failed.value.logits)[:1], reference(b, 0, chunks[0]), Kind.CHUNKED,
                     context=PREFIX + 6)
    untouched = [i for i, r in enumerate(failed.value.rows) if r is RowState.UNTOUCHED]
    again = b.prefill([sessions[i] for i in untouched], [chunks[i] for i in untouched])
    for row, i in enumerate(untouched):  # run again, as if the failure never happened
        assert_close(b, logits_np(b, again)[row:row + 1], reference(b, i, chunks[i]), Kind.BATCHED, context=PREFIX + 6)
    release_all(b, *sessions)


@pytest.mark.numeric
def test_a_decode_that_fails_before_any_state_moved_is_untouched(backend, backend_name):
    b = backend
    sessions = sessions_at_prefix(b, 3)
    tokens = [5, 6, 7]
    with failing_layer(b, backend_name, 0, on_call=1), pytest.raises(BatchFailed) as failed:
        b.decode(sessions, tokens)
    assert failed.value.rows == [RowState.UNTOUCHED] * 3
    assert [s.position for s in sessions] == [PREFIX] * 3
    again = b.decode(sessions, tokens)
    for i, t in enumerate(tokens):
        assert_close(b, logits_np(b, again)[i:i + 1], reference(b, i, [t]), Kind.BATCHED, context=PREFIX + 1)
    release_all(b, *sessions)


@pytest.mark.numeric
def test_a_decode_that_fails_midway_is_classified_and_leaves_the_backend_consistent(backend, backend_name):
    b = backend
    sessions = sessions_at_prefix(b, 3)
    b.decode(sessions, [5, 6, 7])  # on MLX: now a persistent decode batch
    with failing_layer(b, backend_name, 1, on_call=1), pytest.raises(BatchFailed) as failed:
        b.decode(sessions, [8, 9, 10])
    touched = first_layer_writes(b, backend_name)
    assert failed.value.rows == [RowState.CORRUPT if touched else RowState.UNTOUCHED] * 3
    assert [s.position for s in sessions] == [PREFIX + 1] * 3
    if backend_name == "mlx":  # the batch was abandoned: its sessions are refused from now on
        with pytest.raises(BatchFailed) as again:
            b.prefill([sessions[0]], [[4]])
        assert again.value.rows == [RowState.CORRUPT]
    elif not touched:
        logits = b.decode(sessions, [8, 9, 10])
        for i, (t0, t1) in enumerate(zip([5, 6, 7], [8, 9, 10])):
            assert_close(b, logits_np(b, logits)[i:i + 1], reference(b, i, [t0, t1]), Kind.BATCHED, context=PREFIX + 2)
    release_all(b, *sessions)
    # Whatever failed, a new batch runs and matches its references.
    fresh_sessions = sessions_at_prefix(b, 2)
    logits = b.decode(fresh_sessions, [11, 12])
    for i, t in enumerate([11, 12]):
        assert_close(b, logits_np(b, logits)[i:i + 1], reference(b, i, [t]), Kind.BATCHED, context=PREFIX + 1)
    release_all(b, *fresh_sessions)


@pytest.mark.numeric
@pytest.mark.parametrize("layer", [0, 1])
def test_a_failed_verify_is_classified_as_one_pass(backend, backend_name, layer):
    """A verify call of a drafted row and a plain one (one pass on both backends: on MLX the decode
    batch's step) fails at `layer`: before any state moved both are UNTOUCHED and run again as if it
    never happened; after, the rows are CORRUPT alike (MLX abandons its batch)."""
    b = backend
    if not b.rolls_back:
        pytest.skip("this model does not roll drafted tokens back here")
    sessions = sessions_at_prefix(b, 2)
    chunks = [[5, 6, 7], [8]]
    with failing_layer(b, backend_name, layer, on_call=1), pytest.raises(BatchFailed) as failed:
        b.verify(sessions, chunks, [3, 1])
    touched = layer > 0 and first_layer_writes(b, backend_name)
    assert failed.value.rows == [RowState.CORRUPT if touched else RowState.UNTOUCHED] * 2
    assert [s.position for s in sessions] == [PREFIX] * 2
    if not touched:
        out = logits_np(b, b.verify(sessions, chunks, [3, 1]))
        assert_close(b, out[2:3], reference(b, 0, chunks[0]), Kind.BATCHED, context=PREFIX + 3)
        assert_close(b, out[3:4], reference(b, 1, chunks[1]), Kind.BATCHED, context=PREFIX + 1)
    release_all(b, *sessions)


@pytest.mark.parametrize("layer", [0, 1])
async def test_a_failed_decode_step_through_the_engine(backend_name, arch, tiny_model_dir, layer):
    """One decode step of three requests fails at `layer`: requests the backend left untouched
    run again and give exactly their lone tokens; those it left corrupt fail; nothing leaks."""
    from engine_harness import WHOLE_PROMPTS, real_engine, run, settled

    engine = await real_engine(backend_name, tiny_model_dir(arch), **WHOLE_PROMPTS, prefix_cache_entries=0)
    b = engine.backend
    prompts = [prompt(PREFIX, seed=40 + i) for i in range(3)]
    alone = [(await run(engine, p, 12))[0] for p in prompts]
    fired = []

    def when(args) -> bool:  # the first decode step of all three: 3 tokens ([3, width] in torch's
        # varlen pass, [3 rows, 1 token, width] in MLX's batch); the prompts prefill 20 tokens each
        if not fired and tuple(args[0].shape[:-1]) in ((3,), (3, 1)):
            fired.append(True)
            return True
        return False

    with failing_layer(b, backend_name, layer, on_call=when):
        together = await asyncio.gather(*(run(engine, p, 12) for p in prompts))
    assert fired
    corrupt = layer > 0 and first_layer_writes(b, backend_name)
    for want, (tokens, done) in zip(alone, together):
        if corrupt:
            assert done.finish_reason == "error" and "partly written" in done.error
            assert tokens == want[:len(tokens)]
        else:
            assert done.finish_reason == "length" and tokens == want
    await settled(engine, b)
    await engine.shutdown(1)
    assert b.live_sessions() == 0


def test_a_failed_sample_changes_no_stream_and_no_output(backend, backend_name, monkeypatch):
    """The runner samples again row by row after a failure: rows drawn before the failing one
    must not have moved their streams, or a seeded request would not replay."""
    import importlib
    module = importlib.import_module(f"kvfork.backends.{backend_name}.sampling")
    cut = "truncate" if backend_name == "torch" else "truncated"
    real = getattr(module, cut)

    def failing(row, p):
        if p.seed == 666:
            raise RuntimeError("injected")
        return real(row, p)
    a, b = fresh(backend, prompt(12, seed=3))[0], fresh(backend, prompt(7, seed=4))[0]
    logits = backend.decode([a, b], [9, 10])
    hot = [SamplingParams(temperature=30.0, seed=seed) for seed in (1, 666)]
    want = backend.sample(logits, [SamplerState(hot[0]), SamplerState(SamplingParams())])[0].token
    monkeypatch.setattr(module, cut, failing)
    states = [SamplerState(p) for p in hot]
    with pytest.raises(RuntimeError, match="injected"):
        backend.sample(logits, states)
    assert [st.output for st in states] == [[], []]
    picked = backend.sample(logits, [states[0], SamplerState(SamplingParams())])[0].token
    assert picked == want  # the seeded row's first draw, as if the failure never happened
    release_all(backend, a, b)
