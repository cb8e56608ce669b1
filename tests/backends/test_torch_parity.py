"""The torch backend against mlx-lm itself: same folders, same tokens, same logits (float32, CPU).

mlx-lm is the reference here, not our MLX backend: a bug shared by both of our
backends must not be able to pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", exc_type=ImportError)
mlx_lm = pytest.importorskip("mlx_lm", exc_type=ImportError)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvfork.backends.base import SamplerState, SamplingParams  # noqa: E402
from kvfork.backends.torch.backend import TorchBackend  # noqa: E402
from tolerance import Kind, Model, assert_arrays_close, assert_logits_close, assert_same_greedy  # noqa: E402

PROMPT_LEN = 40  # longer than gemma3's window (16), so its rings wrap during prefill
CHUNKS = (0, 7, 25, PROMPT_LEN)  # the engine's chunking: uneven, one chunk longer than the window
DECODE_STEPS = 20


@pytest.fixture(scope="module")
def references():
    """mlx-lm models loaded once per arch."""
    loaded = {}

    def get(folder: str):
        if folder not in loaded:
            loaded[folder] = mlx_lm.load(folder)[0]
        return loaded[folder]

    return get


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def _close(got: np.ndarray, want: np.ndarray, folder: str, context: int) -> None:
    assert_logits_close(got, want, kind=Kind.BACKENDS, model=Model.of(folder), context=context)


@pytest.mark.numeric
def test_prefill_and_teacher_forced_decode_match_mlx_lm(arch, tiny_model_dir, references):
    folder = tiny_model_dir(arch)
    reference = references(folder)
    backend = TorchBackend("cpu")
    backend.load(folder, "float32")
    prompt, forced = _tokens(1, PROMPT_LEN), _tokens(2, DECODE_STEPS)

    cache = make_prompt_cache(reference)
    want = np.array(reference(mx.array([prompt]), cache=cache)[0, -1])
    session = backend.open_session()
    chunks = [prompt[a:b] for a, b in zip(CHUNKS, CHUNKS[1:])]
    for chunk in chunks:
        got = backend.to_numpy(backend.prefill([session], [chunk]))[0]
    _close(got, want, folder, PROMPT_LEN)

    for step, token in enumerate(forced):
        want = np.array(reference(mx.array([[token]]), cache=cache)[0, -1])
        _close(backend.to_numpy(backend.decode([session], [token]))[0], want, folder, PROMPT_LEN + step + 1)


@pytest.mark.numeric
def test_batched_decode_matches_mlx_lm_per_row(arch, tiny_model_dir, references):
    """Rows at different lengths (some past the sliding window) decoded in one pass."""
    folder = tiny_model_dir(arch)
    reference = references(folder)
    backend = TorchBackend("cpu")
    backend.load(folder, "float32")
    lengths = (3, 15, 17, 33)
    prompts = [_tokens(10 + i, n) for i, n in enumerate(lengths)]
    caches, sessions = [], []
    for prompt in prompts:
        caches.append(make_prompt_cache(reference))
        reference(mx.array([prompt]), cache=caches[-1])
        sessions.append(backend.open_session())
        backend.prefill([sessions[-1]], [prompt])
    for step in range(5):
        tokens = _tokens(100 + step, len(lengths))
        got = backend.to_numpy(backend.decode(sessions, tokens))
        for row, (token, cache) in enumerate(zip(tokens, caches)):
            _close(got[row], np.array(reference(mx.array([[token]]), cache=cache)[0, -1]), folder,
                   lengths[row] + step + 1)


@pytest.mark.numeric
def test_greedy_continuations_agree(arch, tiny_model_dir, references):
    """Same logits, same argmax: the greedy tokens of both sides are the same (tolerance.assert_same_greedy)."""
    folder = tiny_model_dir(arch)
    reference = references(folder)
    backend = TorchBackend("cpu")
    backend.load(folder, "float32")
    prompt = _tokens(3, 12)
    cache = make_prompt_cache(reference)
    logits = reference(mx.array([prompt]), cache=cache)[0, -1]
    session = backend.open_session()
    ours = backend.prefill([session], [prompt])
    want, got = ([], []), ([], [])
    for _ in range(24):
        want[1].append(np.array(logits))
        got[1].append(backend.to_numpy(ours)[0])
        want[0].append(int(mx.argmax(logits)))
        got[0].append(backend.sample(ours, [SamplerState(SamplingParams())])[0].token)
        if got[0][-1] != want[0][-1]:
            break  # assert_same_greedy says whether a near tie allowed it
        logits = reference(mx.array([[want[0][-1]]]), cache=cache)[0, -1]
        ours = backend.decode([session], [got[0][-1]])
    assert_same_greedy(got, want, kind=Kind.BACKENDS, model=Model.of(folder), context=12 + 24)



@pytest.mark.numeric
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "longrope", "original_max_position_embeddings": 4096,
         "short_factor": [1.0] * 64, "long_factor": [1.0 + i / 16 for i in range(64)]},
    ],
)
def test_rope_frequencies_match_mlx_lm(scaling):
    """Frequencies and the attention factor (YaRN's mscale, LongRoPE's scale on q and k) as mlx-lm's rope classes."""
    from mlx_lm.models.rope_utils import initialize_rope

    from kvfork.backends.torch.config import Rope
    from kvfork.backends.torch.rope import inverse_frequencies

    head_dim, theta = 128, 500000.0
    inv_freq, scale = inverse_frequencies(Rope(theta, scaling, 131072), head_dim)
    ours = inv_freq.numpy()
    rope = initialize_rope(head_dim, theta, False, scaling, 131072)
    if hasattr(rope, "_freqs"):  # llama3, yarn, longrope: mlx-lm keeps the periods theta^(2i/d), reshaped
        want = 1.0 / np.array(rope._freqs)
    else:  # nn.RoPE: plain base, a linear factor as `scale` on the positions
        want = rope.scale * theta ** (-np.arange(0, head_dim, 2) / head_dim)
    want_scale = getattr(rope, "mscale", None) or getattr(rope, "_scale", 1.0)
    scaled = scaling is not None and scaling["rope_type"] in ("yarn", "longrope")
    assert scale == pytest.approx(want_scale, rel=1e-6) and (scale != 1.0) == scaled
    assert_arrays_close(ours, want, kind=Kind.BACKENDS, reductions=(1,) * 4, condition=math.log(theta), each=True)
