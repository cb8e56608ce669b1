"""Backends loaded once per (backend, arch) for the backend tests, and helpers
that drive them. Every backend must pass the same tests: they are the parity
contract between MLX and torch."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from backends import BACKENDS, create_backend
from backends.base import SamplerState, SamplingParams

BACKEND_NAMES = tuple(BACKENDS)
ATOL, RTOL = 1e-5, 1e-4
_loaded: dict[tuple[str, str], object] = {}


def _importable(name: str) -> bool:
    try:
        importlib.import_module(BACKENDS[name].split(":")[0])
    except ImportError:
        return False
    return True


@pytest.fixture(params=BACKEND_NAMES)
def backend_name(request) -> str:
    if not _importable(request.param):
        pytest.skip(f"the {request.param} backend cannot be imported here")
    return request.param


@pytest.fixture
def backend(backend_name, arch, tiny_model_dir):
    """A loaded float32 backend; the test must leave no session open behind it."""
    key = (backend_name, arch)
    if key not in _loaded:
        b = create_backend(backend_name)
        b.load(tiny_model_dir(arch), "float32")
        _loaded[key] = b
    b = _loaded[key]
    before = b.live_sessions()
    yield b
    assert b.live_sessions() == before, "the test left sessions open"


def prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def logits_np(b, logits) -> np.ndarray:
    return np.asarray(b.to_numpy(logits), dtype=np.float32)


def assert_close(b, got, want) -> None:
    np.testing.assert_allclose(logits_np(b, got), logits_np(b, want), atol=ATOL, rtol=RTOL)


def greedy(b, logits) -> list[int]:
    states = [SamplerState(SamplingParams()) for _ in range(logits_np(b, logits).shape[0])]
    return [s.token for s in b.sample(logits, states)]


def fresh(b, tokens: list[int], chunk: int = 0):
    """A new session fed `tokens` (in chunks of `chunk` when set); returns (session, last logits)."""
    s = b.open_session()
    step = chunk or len(tokens)
    for i in range(0, len(tokens), step):
        logits = b.prefill([s], [tokens[i : i + step]])
    return s, logits


def continue_greedy(b, session, logits, n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy steps from `logits`; the tokens and each step's logits."""
    tokens, seen = [], []
    for _ in range(n):
        token = greedy(b, logits)[0]
        tokens.append(token)
        logits = b.decode([session], [token])
        seen.append(logits_np(b, logits))
    return tokens, seen


def release_all(b, *sessions) -> None:
    for s in sessions:
        b.release(s)
