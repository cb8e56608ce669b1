"""Torch backend: clone exactness and isolation, the sliding-window rule, batched decode,
buffer growth and byte accounting. Float32; the device is KVFORK_DEVICE (cpu by default)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from backends.base import CloneRefused
from backends.torch import kv
from backends.torch.backend import TorchBackend

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")
ATOL, RTOL = 1e-5, 1e-4
WINDOW = 16  # tiny gemma3's sliding window (tests/tiny_models.py)


@pytest.fixture(scope="module")
def backends():
    loaded = {}

    def get(folder: str) -> TorchBackend:
        if folder not in loaded:
            loaded[folder] = TorchBackend(DEVICE)
            loaded[folder].load(folder, "float32")
        return loaded[folder]

    return get


@pytest.fixture
def backend(arch, tiny_model_dir, backends) -> TorchBackend:
    return backends(tiny_model_dir(arch))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def fed(backend: TorchBackend, prompt: list[int]):
    """A fresh session given the whole prompt, and its last logits."""
    session = backend.open_session()
    return session, backend.to_numpy(backend.prefill([session], [prompt]))[0]


def run(backend: TorchBackend, session, steps: list[int]) -> np.ndarray:
    return np.stack([backend.to_numpy(backend.decode([session], [t]))[0] for t in steps])


def greedy(backend: TorchBackend, session, logits: np.ndarray, n: int) -> list[int]:
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = backend.to_numpy(backend.decode([session], [out[-1]]))[0]
    return out


@pytest.mark.parametrize("p", [1, 9, 16, 17, 31])
@pytest.mark.parametrize("donor_ahead", [0, 1])
def test_clone_then_prefill_rest_equals_fresh(backend, p, donor_ahead):
    prompt = tokens(p, 40)
    donor = backend.open_session()
    backend.prefill([donor], [prompt[: p + donor_ahead]])
    clone = backend.clone(donor, p)
    assert clone.position == p
    got = backend.to_numpy(backend.prefill([clone], [prompt[p:]]))[0]
    fresh, want = fed(backend, prompt)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert greedy(backend, clone, got, 8) == greedy(backend, fresh, want, 8)
    for s in (donor, clone, fresh):
        backend.release(s)


def test_identical_prompt_is_served_from_a_snapshot(backend):
    """Capacity W lets a snapshot at L serve a clone at L - 1 (the last token re-runs)."""
    prompt = tokens(5, 3 * WINDOW + 3)
    donor, want = fed(backend, prompt)
    clone = backend.clone(donor, len(prompt) - 1)
    got = backend.to_numpy(backend.prefill([clone], [prompt[-1:]]))[0]
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_clone_isolation_both_keep_running(backend):
    prompt, a, b = tokens(7, 20), tokens(8, 20), tokens(9, 20)
    donor = backend.open_session()
    backend.prefill([donor], [prompt])
    clone = backend.clone(donor, 20)
    got = [backend.to_numpy(backend.decode([donor, clone], [x, y])) for x, y in zip(a, b)]
    ref_a, ref_b = fed(backend, prompt)[0], fed(backend, prompt)[0]
    np.testing.assert_allclose(np.stack([g[0] for g in got]), run(backend, ref_a, a), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.stack([g[1] for g in got]), run(backend, ref_b, b), atol=ATOL, rtol=RTOL)


def test_clone_survives_releasing_its_donor(backend):
    prompt, steps = tokens(11, 24), tokens(12, 10)
    donor = backend.open_session()
    backend.prefill([donor], [prompt])
    clone = backend.clone(donor, 24)
    backend.release(donor)
    backend.release(donor)  # twice is a no-op
    reference = fed(backend, prompt)[0]
    np.testing.assert_allclose(run(backend, clone, steps), run(backend, reference, steps), atol=ATOL, rtol=RTOL)


def test_batched_decode_equals_each_alone(backend):
    lengths = (2, 15, 17, 40)
    prompts = [tokens(20 + n, n) for n in lengths]
    together = [fed(backend, p)[0] for p in prompts]
    alone = [fed(backend, p)[0] for p in prompts]
    for step in range(4):
        step_tokens = tokens(30 + step, len(lengths))
        got = backend.to_numpy(backend.decode(together, step_tokens))
        for row, (session, token) in enumerate(zip(alone, step_tokens)):
            want = backend.to_numpy(backend.decode([session], [token]))[0]
            np.testing.assert_allclose(got[row], want, atol=ATOL, rtol=RTOL)


def test_sliding_rule_decides_every_clone(tiny_model_dir, backends):
    """Exhaustive over positions and cut points: served iff every sliding layer still holds
    [upto - W + 1, upto); refused otherwise, and a refusal leaves the donor as it was."""
    backend = backends(tiny_model_dir("gemma3"))
    steps = tokens(40, 2 * WINDOW + 4)
    donor, _ = fed(backend, steps[:1])
    reference, _ = fed(backend, steps[:1])
    for position in range(1, len(steps)):
        for upto in range(-1, position + 2):
            allowed = 1 <= upto <= position and (position <= WINDOW or upto >= position - 1)
            before = (donor.position, backend.session_bytes(donor), backend.live_sessions())
            if allowed:
                backend.release(backend.clone(donor, upto))
            else:
                with pytest.raises(CloneRefused):
                    backend.clone(donor, upto)
            assert (donor.position, backend.session_bytes(donor), backend.live_sessions()) == before
        got = backend.to_numpy(backend.decode([donor], [steps[position]]))[0]
        want = backend.to_numpy(backend.decode([reference], [steps[position]]))[0]
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_clone_of_a_clone_holds_one_position_less(tiny_model_dir, backends):
    """A clone at L - 1 of a donor at L holds [L - W, L - 1): it can serve a clone at its own
    position, never one earlier (the donor's position L sits where L - W would be)."""
    backend = backends(tiny_model_dir("gemma3"))
    prompt = tokens(41, 2 * WINDOW + 5)
    donor, _ = fed(backend, prompt)
    first = backend.clone(donor, len(prompt) - 1)
    with pytest.raises(CloneRefused, match="window_overwritten"):
        backend.clone(first, len(prompt) - 2)
    second = backend.clone(first, len(prompt) - 1)
    got = backend.to_numpy(backend.prefill([second], [prompt[-1:]]))[0]
    np.testing.assert_allclose(got, fed(backend, prompt)[1], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("chunks", [(300,), (255, 1, 44), (200, 56, 1, 43)])
def test_buffers_grow_across_steps(tiny_model_dir, backends, chunks):
    backend = backends(tiny_model_dir("llama"))
    prompt = tokens(50, sum(chunks))
    session, start = backend.open_session(), 0
    for n in chunks:
        got = backend.to_numpy(backend.prefill([session], [prompt[start : start + n]]))[0]
        start += n
    assert backend.session_bytes(session) >= 2 * kv.GROW_STEP * backend.info.kv_bytes_per_token
    np.testing.assert_allclose(got, fed(backend, prompt)[1], atol=ATOL, rtol=RTOL)


def test_byte_accounting(backend):
    start_live, start_total = backend.live_sessions(), backend.total_bytes()
    donor, _ = fed(backend, tokens(60, 30))
    clone = backend.clone(donor, 30)
    assert backend.live_sessions() == start_live + 2
    assert backend.session_bytes(clone) >= 30 * backend.info.kv_bytes_per_token
    assert backend.total_bytes() == start_total + backend.session_bytes(donor) + backend.session_bytes(clone)
    backend.release(donor)
    backend.release(clone)
    assert (backend.live_sessions(), backend.total_bytes()) == (start_live, start_total)


def test_model_info(tiny_model_dir, backends):
    info = backends(tiny_model_dir("gemma3")).info
    assert [(layer.kind, layer.window) for layer in info.layers] == [("sliding", 16), ("sliding", 16), ("full", None)]
    assert info.kv_bytes_per_token == 2 * 2 * 16 * 4  # one full layer, k and v, 2 heads x 16 dims, fp32
    assert info.dtype == "float32" and info.vocab_size == 512 and info.eos_token_ids


def test_bad_calls_are_clear_errors(backend):
    session, _ = fed(backend, tokens(70, 5))
    with pytest.raises(ValueError, match="twice"):
        backend.decode([session, session], [1, 2])
    with pytest.raises(ValueError, match="empty"):
        backend.prefill([session], [[]])
    backend.release(session)
    with pytest.raises(ValueError, match="released"):
        backend.decode([session], [1])
