"""The MLX backend on hybrid models through mlx-lm's own models and caches (ArraysCache beside
KVCache): Qwen3.5 dense and MoE and Qwen3-Next in both checkpoint layouts, and LFM2 (short
convolutions, MLX only). Batched decode merges and extracts recurrent states along the batch
axis; a clone is served at the session's position only."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", exc_type=ImportError)
mlx_lm = pytest.importorskip("mlx_lm", exc_type=ImportError)

from backends.base import CloneRefused  # noqa: E402
from backends.mlx.backend import MLXBackend  # noqa: E402
from tiny_hybrid_models import HYBRID_ARCHS, write_lfm2_model  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4
MODELS = [(arch, "hf") for arch in HYBRID_ARCHS] + [("qwen3_5", "mlx"), ("lfm2", "mlx")]
_loaded: dict[tuple[str, str], MLXBackend] = {}


@pytest.fixture(scope="session")
def lfm2_dir(tmp_path_factory) -> str:
    return str(write_lfm2_model(tmp_path_factory.mktemp("lfm2")))


@pytest.fixture(params=MODELS, ids=lambda m: "-".join(m))
def hybrid(request, tiny_hybrid_dir, lfm2_dir) -> MLXBackend:
    arch, layout = request.param
    if request.param not in _loaded:
        b = MLXBackend()
        b.load(lfm2_dir if arch == "lfm2" else tiny_hybrid_dir(arch, layout), "float32")
        _loaded[request.param] = b
    b = _loaded[request.param]
    before = b.live_sessions()
    yield b
    assert b.live_sessions() == before, "the test left sessions open"


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def feed(b: MLXBackend, prompt: list[int], chunks=None):
    session, start = b.open_session(), 0
    for n in chunks or (len(prompt),):
        logits = b.prefill([session], [prompt[start : start + n]])
        start += n
    return session, b.to_numpy(logits)


def test_layers_are_described_and_the_state_counted(hybrid):
    kinds = {layer.kind for layer in hybrid.info.layers}
    assert kinds == {"recurrent", "full"}
    assert hybrid.info.recurrent_bytes > 0
    session, _ = feed(hybrid, tokens(1, 5))
    assert hybrid.session_bytes(session) >= hybrid.info.recurrent_bytes
    hybrid.release(session)


def test_chunked_prefill_and_decode_match_one_plain_pass(hybrid):
    prompt = tokens(2, 60)
    whole, want = feed(hybrid, prompt)
    chunked, got = feed(hybrid, prompt, (7, 1, 52))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    for token in tokens(3, 4):
        np.testing.assert_allclose(hybrid.to_numpy(hybrid.decode([chunked], [token])),
                                   hybrid.to_numpy(hybrid.decode([whole], [token])), atol=ATOL, rtol=RTOL)
    hybrid.release(whole)
    hybrid.release(chunked)


def test_batched_decode_of_four_sessions_equals_each_alone(hybrid):
    prompts = [tokens(10 + i, n) for i, n in enumerate((1, 9, 40, 70))]
    together = [feed(hybrid, p)[0] for p in prompts]
    alone = [feed(hybrid, p)[0] for p in prompts]
    for step in range(4):
        step_tokens = tokens(100 + step, 4)
        batched = hybrid.to_numpy(hybrid.decode(together, step_tokens))
        for row, (session, token) in enumerate(zip(alone, step_tokens)):
            np.testing.assert_allclose(batched[row], hybrid.to_numpy(hybrid.decode([session], [token]))[0],
                                       atol=ATOL, rtol=RTOL)
    for s in together + alone:
        hybrid.release(s)


@pytest.mark.parametrize("donor_in_batch", [False, True])
def test_a_clone_at_the_position_is_exact_and_independent(hybrid, donor_in_batch):
    prompt, rest = tokens(4, 50), tokens(5, 5)
    donor, _ = feed(hybrid, prompt)
    other, _ = feed(hybrid, tokens(6, 20))
    if donor_in_batch:  # the donor is a row of the decode batch: its state is extracted
        hybrid.decode([other, donor], [3, prompt[-1]])
        prompt = prompt + [prompt[-1]]
    clone = hybrid.clone(donor, len(prompt))
    reference, _ = feed(hybrid, prompt)
    hybrid.decode([donor, other], [7, 8])  # the donor moves on: the clone must not see it
    for token in rest:
        want = hybrid.to_numpy(hybrid.decode([reference], [token]))
        np.testing.assert_allclose(hybrid.to_numpy(hybrid.decode([clone], [token])), want, atol=ATOL, rtol=RTOL)
    for s in (donor, other, clone, reference):
        hybrid.release(s)


def test_a_clone_elsewhere_is_refused_and_changes_nothing(hybrid):
    prompt, rest = tokens(7, 40), tokens(8, 4)
    donor, _ = feed(hybrid, prompt)
    twin, _ = feed(hybrid, prompt)
    live, held = hybrid.live_sessions(), hybrid.total_bytes()
    with pytest.raises(CloneRefused) as refused:
        hybrid.clone(donor, 39)
    assert refused.value.reason == "recurrent_position"
    assert (hybrid.live_sessions(), hybrid.total_bytes(), donor.position) == (live, held, 40)
    for token in rest:
        want = hybrid.to_numpy(hybrid.decode([twin], [token]))
        np.testing.assert_array_equal(hybrid.to_numpy(hybrid.decode([donor], [token])), want)
    hybrid.release(donor)
    hybrid.release(twin)
