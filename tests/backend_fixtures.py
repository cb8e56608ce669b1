"""Backends loaded once per (backend, model) for the backend tests, lent to one test at a time,
and helpers that drive them. Every backend must pass the same tests: they are the parity
contract between MLX and torch. Registered as a pytest plugin (conftest.py), for its
report hook."""

from __future__ import annotations

import importlib
import weakref
from typing import Callable, Hashable, Iterator

import numpy as np
import pytest
from tolerance import Kind, Model, assert_logits_close, assert_same_greedy

from kvfork.backends import BACKENDS, create_backend
from kvfork.backends.base import Backend, SamplerState, SamplingParams

BACKEND_NAMES = tuple(BACKENDS)
_loaded: dict[Hashable, Backend] = {}
_models: weakref.WeakKeyDictionary[Backend, Model] = weakref.WeakKeyDictionary()


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


def load(backend: str | Backend, folder: str, dtype: str | None = "float32") -> Backend:
    """`backend` (a name, or one not loaded yet) with the model in `folder`; its sizes are noted for
    the tolerance model (`model_of`)."""
    b = create_backend(backend) if isinstance(backend, str) else backend
    b.load(folder, dtype)
    _models[b] = Model.of(folder)
    return b


def model_of(b: Backend) -> Model:
    return _models[b]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's report on the test item (item.rep_setup, rep_call), so a fixture's teardown knows
    whether its test failed (pytest's own recipe)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def lent(request, key: Hashable, make: Callable[[], Backend]) -> Iterator[Backend]:
    """The backend of `key`, made once for the run, lent to the test that asked: every session it opens,
    clones or imports is released when the test ends, passed or failed. A test that passed with sessions
    still open fails on its own ("test X leaked N sessions"); after a failure or a leak, or when the
    backend does not come back to what it held before, it is dropped, and the next test loads a fresh one."""
    b = _loaded.get(key)
    if b is None:
        b = _loaded[key] = make()
    handed: list = []

    def recording(method):
        def handing(*args, **kwargs):
            session = method(*args, **kwargs)
            handed.append(session)
            return session
        return handing

    for name in ("open_session", "clone", "import_state"):
        setattr(b, name, recording(getattr(b, name)))
    live, held = b.live_sessions(), b.total_bytes()
    try:
        yield b
    finally:
        for name in ("open_session", "clone", "import_state"):
            delattr(b, name)
        still_open = b.live_sessions()
        for session in handed:
            b.release(session)  # a no-op for one released already
        leaked = still_open - b.live_sessions()
        call = getattr(request.node, "rep_call", None)
        failed = call is None or call.failed
        if failed or leaked or (b.live_sessions(), b.total_bytes()) != (live, held):
            _loaded.pop(key, None)
        if leaked and not failed:
            pytest.fail(f"{request.node.nodeid} leaked {leaked} sessions", pytrace=False)


@pytest.fixture
def backend(request, backend_name, arch, tiny_model_dir):
    """A loaded float32 backend (`lent`)."""
    yield from lent(request, (backend_name, arch), lambda: load(backend_name, tiny_model_dir(arch)))


def prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def logits_np(b, logits) -> np.ndarray:
    """The backend's logits (or rows already taken out) as a float32 numpy array of their own: a copy, since a
    backend may write its next logits where these lie."""
    return np.array(logits if isinstance(logits, np.ndarray) else b.to_numpy(logits), dtype=np.float32)


def assert_close(b, got, want, kind: Kind, context: int) -> None:
    """Logits of `b`'s model along two paths (tolerance.py), for last tokens that see `context` tokens."""
    assert_logits_close(logits_np(b, got), logits_np(b, want), kind=kind, model=model_of(b), context=context)


def assert_greedy_close(b, got, want, kind: Kind, context: int) -> int:
    """Two `continue_greedy` results along two paths: the same greedy tokens (tolerance.assert_same_greedy)."""
    return assert_same_greedy(got, want, kind=kind, model=model_of(b), context=context)


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


def continue_greedy(b, session, logits, n: int, beside=()) -> tuple[list[int], list[np.ndarray]]:
    """n greedy steps from `logits` (a batch of one row), the sessions `beside` decoding with it (token 7 each);
    the tokens, and the logits each was picked from."""
    tokens, seen = [], []
    for _ in range(n):
        seen.append(logits_np(b, logits))
        tokens.append(greedy(b, logits)[0])
        logits = b.decode([session, *beside], [tokens[-1]] + [7] * len(beside))[:1]
    return tokens, seen


def release_all(b, *sessions) -> None:
    for s in sessions:
        b.release(s)


def assert_every_path_gives_the_same_bits(b: Backend, paths: Iterator[tuple], steps: int) -> None:
    """For each (name, session, logits, sessions beside it) of `paths` (each session holding one prompt, reached
    another way: --batch-invariant's tests), the prompt's last logits and those of `steps` greedy steps after it
    (the sessions beside decoding with it) are bit for bit the first path's."""
    reference = None
    for name, session, logits, beside in paths:
        _, got = continue_greedy(b, session, logits[None], steps + 1, beside)
        if reference is None:
            reference = got
            continue
        for step, (want, have) in enumerate(zip(reference, got)):
            assert np.array_equal(want, have), f"{name}, step {step}: {float(np.abs(want - have).max()):.3g}"
