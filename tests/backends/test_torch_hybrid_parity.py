"""The torch backend's hybrids (Qwen3.5 dense and MoE, Qwen3-Next) against mlx-lm itself, in
both checkpoint layouts: same tokens, same logits (float32, CPU). As test_torch_parity.py."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", exc_type=ImportError)
mlx_lm = pytest.importorskip("mlx_lm", exc_type=ImportError)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvfork.backends.torch.backend import TorchBackend  # noqa: E402
from tiny_hybrid_models import HYBRID_ARCHS, LAYOUTS  # noqa: E402
from tolerance import Kind, Model, assert_logits_close  # noqa: E402

PROMPT_LEN = 150  # past one 64-token chunk of the delta rule's chunked form
CHUNKS = (0, 7, 100, 101, PROMPT_LEN)  # uneven, one of a single token, one over a chunk of the rule
DECODE_STEPS = 12


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def _close(got: np.ndarray, want: np.ndarray, folder: str, context: int) -> None:
    assert_logits_close(got, want, kind=Kind.BACKENDS, model=Model.of(folder), context=context)


@pytest.mark.numeric
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_chunked_prefill_and_teacher_forced_decode_match_mlx_lm(arch, layout, tiny_hybrid_dir):
    folder = tiny_hybrid_dir(arch, layout)
    reference = mlx_lm.load(folder)[0]
    backend = TorchBackend("cpu")
    backend.load(folder, "float32")
    prompt, forced = _tokens(1, PROMPT_LEN), _tokens(2, DECODE_STEPS)

    cache = make_prompt_cache(reference)
    want = np.array(reference(mx.array([prompt]), cache=cache)[0, -1])
    session = backend.open_session()
    for a, b in zip(CHUNKS, CHUNKS[1:]):
        got = backend.to_numpy(backend.prefill([session], [prompt[a:b]]))[0]
    _close(got, want, folder, PROMPT_LEN)

    for step, token in enumerate(forced):
        want = np.array(reference(mx.array([[token]]), cache=cache)[0, -1])
        _close(backend.to_numpy(backend.decode([session], [token]))[0], want, folder, PROMPT_LEN + step + 1)


@pytest.mark.numeric
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_batched_decode_matches_mlx_lm_per_row(arch, tiny_hybrid_dir):
    """Rows at different lengths, each with its own recurrent state, decoded in one pass."""
    folder = tiny_hybrid_dir(arch)
    reference = mlx_lm.load(folder)[0]
    backend = TorchBackend("cpu")
    backend.load(folder, "float32")
    lengths = (1, 3, 17, 70)
    caches, sessions = [], []
    for i, n in enumerate(lengths):
        prompt = _tokens(10 + i, n)
        caches.append(make_prompt_cache(reference))
        reference(mx.array([prompt]), cache=caches[-1])
        sessions.append(backend.open_session())
        backend.prefill([sessions[-1]], [prompt])
    for step in range(4):
        tokens = _tokens(100 + step, len(lengths))
        got = backend.to_numpy(backend.decode(sessions, tokens))
        for row, (token, cache) in enumerate(zip(tokens, caches)):
            _close(got[row], np.array(reference(mx.array([[token]]), cache=cache)[0, -1]), folder,
                   lengths[row] + step + 1)
