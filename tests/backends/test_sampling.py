"""Sampling, on every backend: per-request settings and streams, greedy as a
plain argmax of the shaped logits, logprobs of the raw distribution."""

from __future__ import annotations

import numpy as np
import pytest
from backend_fixtures import backend, backend_name, fresh, greedy, logits_np, prompt  # noqa: F401  (fixtures)
from tolerance import assert_logprobs_close

from kvfork.backends.base import SamplerState, SamplingParams

HOT = SamplingParams(temperature=30.0)  # hot enough that draws differ between streams


@pytest.fixture
def logits(backend):
    """Last-token logits of two sessions: rows of one batch."""
    a, _ = fresh(backend, prompt(12, seed=3))
    c, _ = fresh(backend, prompt(7, seed=4))
    yield backend.decode([a, c], [9, 10])
    backend.release(a)
    backend.release(c)


def _draws(b, logits, params: SamplingParams, n: int = 24) -> list[int]:
    state = SamplerState(params)
    return [b.sample(logits, [state, SamplerState(SamplingParams())])[0].token for _ in range(n)]


def test_seeded_streams_replay(backend, logits):
    b = backend
    seeded = SamplingParams(temperature=30.0, seed=7)
    first = _draws(b, logits, seeded)
    assert _draws(b, logits, seeded) == first
    assert _draws(b, logits, SamplingParams(temperature=30.0, seed=8)) != first
    assert len(set(first)) > 1
    # A request's stream does not depend on what shares its batch.
    alone, session = SamplerState(seeded), fresh(b, prompt(12, seed=3))[0]
    row0 = b.decode([session], [9])
    assert [b.sample(row0, [alone])[0].token for _ in range(24)] == first
    b.release(session)


def test_greedy_is_argmax_and_top_k_one_is_greedy(backend, logits):
    b = backend
    want = logits_np(b, logits).argmax(axis=-1).tolist()
    assert greedy(b, logits) == want
    states = [SamplerState(SamplingParams(temperature=1.0, top_k=1, seed=s)) for s in (1, 2)]
    for _ in range(5):
        assert [s.token for s in b.sample(logits, states)] == want
    assert states[0].output == [want[0]] * 5  # sample records what it picked


@pytest.mark.parametrize("params", [SamplingParams(), HOT, SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1)])
def test_logit_bias_forces_a_token(backend, logits, params):
    b = backend
    target = int(logits_np(b, logits)[0].argmin())
    biased = SamplingParams(**{**params.__dict__, "logit_bias": {target: 1e4}})
    state = SamplerState(biased)
    assert all(b.sample(logits, [state, SamplerState(HOT)])[0].token == target for _ in range(5))


def test_truncation_keeps_draws_in_the_nucleus(backend, logits):
    b = backend
    row = logits_np(b, logits)[0]
    top3 = set(np.argsort(-row)[:3].tolist())
    assert set(_draws(b, logits, SamplingParams(temperature=50.0, top_k=3, seed=1))) <= top3
    probs = np.exp((row - row.max()) / 10.0)
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.6)) + 1].tolist())
    assert len(nucleus) > 1
    assert set(_draws(b, logits, SamplingParams(temperature=10.0, top_p=0.6, seed=2))) <= nucleus
    scaled = np.exp((row - row.max()) / 50.0)
    kept = set(np.nonzero(scaled >= 0.9 * scaled.max())[0].tolist())
    assert set(_draws(b, logits, SamplingParams(temperature=50.0, min_p=0.9, seed=3))) <= kept


def test_penalties_shape_greedy(backend, logits):
    b = backend
    row = logits_np(b, logits)[0].astype(np.float64)
    top = np.argsort(-row)[:8].tolist()
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4)
    for k in range(4):
        state = SamplerState(params, prompt=top[k : k + 2], output=[top[k + 2], top[k + 3], top[k + 3]])
        want = row.copy()
        for t in set(state.prompt) | set(state.output):
            want[t] = want[t] / 1.5 if want[t] > 0 else want[t] * 1.5
        for t in set(state.output):
            want[t] -= 0.7 + 0.4 * state.output.count(t)
        plain = SamplerState(SamplingParams())
        got = b.sample(logits, [state, plain])
        assert got[0].token == int(want.argmax())
        assert got[1].token == int(logits_np(b, logits)[1].argmax())


def test_logprobs(backend, logits):
    b = backend
    rows = logits_np(b, logits).astype(np.float64)
    raw = rows - rows.max(axis=-1, keepdims=True)
    raw = raw - np.log(np.exp(raw).sum(axis=-1, keepdims=True))
    states = [SamplerState(SamplingParams(logprobs=True, top_logprobs=4)), SamplerState(SamplingParams(logprobs=True))]
    first, second = b.sample(logits, states)
    assert first.token == int(rows[0].argmax())
    ids = [t for t, _ in first.top_logprobs]
    assert ids == np.argsort(-raw[0])[:4].tolist()
    assert second.top_logprobs is None
    got = [first.logprob, *(lp for _, lp in first.top_logprobs), second.logprob]
    assert_logprobs_close(got, [raw[0, first.token], *raw[0, ids], raw[1, second.token]], vocab=rows.shape[1])
    assert b.sample(logits, [SamplerState(SamplingParams())] * 2)[0].logprob is None


def _mask(tokens, vocab: int) -> np.ndarray:
    out = np.zeros((vocab + 31) // 32, dtype=np.uint32)
    for t in tokens:
        out[t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


@pytest.mark.parametrize("params", [SamplingParams(), HOT, SamplingParams(logprobs=True, top_logprobs=3)])
def test_grammar_masks_bind_their_rows_only(backend, logits, params):
    """A constrained row picks only what its mask allows; the unconstrained row of the same batch gets
    exactly the token (and stream) it gets with no mask anywhere; logprobs stay the raw model's."""
    b = backend
    raw = logits_np(b, logits)
    allowed = [int(raw[0].argmin()), 31, 63]  # the row's worst token among them; 31 and 63: a word's sign bit
    seeds = [SamplingParams(**{**params.__dict__, "seed": 5}), SamplingParams(**{**params.__dict__, "seed": 6})]
    plain = [SamplerState(p) for p in seeds]
    masked = [SamplerState(seeds[0], allowed=_mask(allowed, raw.shape[1])), SamplerState(seeds[1])]
    for _ in range(6):
        want, got = b.sample(logits, plain), b.sample(logits, masked)
        assert got[0].token in allowed
        assert got[1].token == want[1].token and got[1].logprob == want[1].logprob
        if params.logprobs:
            row = raw[0].astype(np.float64)
            logprob = row[got[0].token] - (row.max() + np.log(np.exp(row - row.max()).sum()))
            assert_logprobs_close([got[0].logprob], [logprob], vocab=row.size)
    if params.greedy:
        assert got[0].token == max(allowed, key=lambda t: raw[0, t])
