"""The backend contract, run on every backend and every tiny architecture:
clone exactness, isolation, retention, the sliding-window rule, batched decode,
byte and session accounting. Float32, so reuse must give the same answers."""

from __future__ import annotations

import numpy as np
import pytest
from backend_fixtures import (  # noqa: F401  (fixtures)
    assert_close,
    assert_greedy_close,
    backend,
    backend_name,
    continue_greedy,
    fresh,
    logits_np,
    prompt,
    release_all,
)
from tolerance import Kind

from kvfork.backends.base import CloneRefused, clone_refusal

PROMPT = prompt(40)


def _held_from(b, position: int) -> list[int]:
    """What a session that was only prefilled and decoded holds, by the rule."""
    return [max(0, position - layer.window) for layer in b.info.layers if layer.kind == "sliding"]


def test_model_info(backend, arch):
    info = backend.info
    assert info.vocab_size == 512 and info.context_length == 4096 and info.dtype == "float32"
    assert 2 in info.eos_token_ids  # <|im_end|>, from config.json
    kinds = [(layer.kind, layer.window) for layer in info.layers]
    full = 1 if arch == "gemma3" else 2
    assert kinds == ([("sliding", 16)] * 2 if arch == "gemma3" else []) + [("full", None)] * full
    slot = 2 * 2 * 16 * 4  # (k, v) * kv heads * head dim * float32
    assert info.kv.full_bytes_per_token == full * slot
    assert info.kv.ring_bytes == (2 * 16 * slot if arch == "gemma3" else 0)  # a ring of the window per sliding layer


@pytest.mark.numeric
@pytest.mark.parametrize("upto", [1, 7, 16, 17, 30, 39])
def test_clone_exactness(backend, upto):
    b = backend
    reference, want = fresh(b, PROMPT)
    want_greedy = continue_greedy(b, reference, want, 8)
    # Donors at upto (clone at their position) and upto + 1 (a snapshot serving L - 1).
    for donor_length in (upto, upto + 1):
        donor, _ = fresh(b, PROMPT[:donor_length], chunk=6)
        clone = b.clone(donor, upto)
        assert clone.position == upto and donor.position == donor_length
        got = b.prefill([clone], [PROMPT[upto:]])
        assert_greedy_close(b, continue_greedy(b, clone, got, 8), want_greedy, Kind.CLONE, context=48)
        release_all(b, donor, clone)
    b.release(reference)


@pytest.mark.numeric
def test_clone_isolation(backend):
    b = backend
    steps_a, steps_b = prompt(20, seed=1), prompt(20, seed=2)
    start = PROMPT[:30] + steps_a[:1]
    references = []
    for steps in (steps_a, steps_b):
        s, _ = fresh(b, start)
        references.append([logits_np(b, b.decode([s], [t])) for t in steps[1:]])
        b.release(s)
    donor, _ = fresh(b, PROMPT[:30])
    b.decode([donor], steps_a[:1])  # the donor is now a row of the decode batch
    clone = b.clone(donor, 31)
    for i in range(1, 20):
        rows = logits_np(b, b.decode([donor, clone], [steps_a[i], steps_b[i]]))
        assert_close(b, rows[0:1], references[0][i - 1], Kind.BATCHED, context=50)
        assert_close(b, rows[1:2], references[1][i - 1], Kind.BATCHED, context=50)
    assert donor.position == 50 and clone.position == 50
    release_all(b, donor, clone)


@pytest.mark.numeric
def test_clone_survives_donor_release(backend):
    b = backend
    reference, want = fresh(b, PROMPT)
    want_greedy = continue_greedy(b, reference, want, 10)
    donor, _ = fresh(b, PROMPT[:35])
    clone = b.clone(donor, 35)
    b.release(donor)
    b.release(donor)  # twice is a no-op
    grandchild = b.clone(clone, 35)
    b.release(clone)
    got = b.prefill([grandchild], [PROMPT[35:]])
    assert_greedy_close(b, continue_greedy(b, grandchild, got, 10), want_greedy, Kind.CLONE, context=50)
    release_all(b, grandchild, reference)


@pytest.mark.numeric
def test_sliding_window_rule(backend):
    b = backend
    donor, _ = fresh(b, PROMPT[:34], chunk=5)
    for t in PROMPT[34:40]:
        b.decode([donor], [t])
    reference, want = fresh(b, PROMPT + [5])
    live, served = b.live_sessions(), []
    for upto in range(-1, 42):
        refusal = clone_refusal(donor.position, upto, b.info, _held_from(b, donor.position))
        if refusal is None:
            clone = b.clone(donor, upto)
            assert_close(b, b.prefill([clone], [PROMPT[upto:] + [5]]), want, Kind.CLONE, context=41)
            b.release(clone)
            served.append(upto)
            continue
        with pytest.raises(CloneRefused) as caught:
            b.clone(donor, upto)
        assert caught.value.reason == refusal.reason
        assert b.live_sessions() == live and donor.position == 40
    sliding = any(layer.kind == "sliding" for layer in b.info.layers)
    assert served == ([39, 40] if sliding else list(range(1, 41)))
    # A clone at the donor's position holds what the donor held, so it serves L - 1 in turn.
    clone = b.clone(donor, 40)
    grandchild = b.clone(clone, 39)
    assert_close(b, b.prefill([grandchild], [PROMPT[39:] + [5]]), want, Kind.CLONE, context=41)
    # The donor is unchanged by the refusals: it decodes as the uncloned reference.
    assert_close(b, b.decode([donor], [5]), want, Kind.CHUNKED, context=41)
    release_all(b, donor, reference, clone, grandchild)


@pytest.mark.numeric
def test_batched_decode_matches_solo(backend):
    """Sessions of different lengths decoded together give each one's solo logits,
    also while sessions join, sit a step out, and leave."""
    b = backend
    lanes = {}  # lane -> (batched session, solo reference session)

    def add(lane: int, length: int) -> None:
        tokens = prompt(length, seed=10 + lane)
        lanes[lane] = (fresh(b, tokens, chunk=4)[0], fresh(b, tokens)[0])

    def step(active: list[int], seed: int) -> None:
        tokens = prompt(len(active), seed=seed)
        rows = logits_np(b, b.decode([lanes[k][0] for k in active], tokens))
        for row, lane, token in zip(rows, active, tokens):
            solo = logits_np(b, b.decode([lanes[lane][1]], [token]))
            assert_close(b, row[None], solo, Kind.BATCHED, context=50)

    for lane, length in enumerate((5, 12, 23, 37)):
        add(lane, length)
    for i in range(3):
        step([0, 1, 2, 3], seed=100 + i)
    release_all(b, *lanes.pop(1))  # leaves
    add(4, 9)  # joins
    step([3, 0, 4, 2], seed=200)
    step([0, 4], seed=201)  # 2 and 3 sit out
    b.prefill([lanes[3][0]], [[7, 8, 9]])  # a batch row takes more prompt
    b.prefill([lanes[3][1]], [[7, 8, 9]])
    for i in range(3):
        step([2, 3, 0, 4], seed=300 + i)
    for pair in lanes.values():
        release_all(b, *pair)


def test_bytes_and_sessions_return_to_baseline(backend):
    b = backend
    live, total = b.live_sessions(), b.total_bytes()
    s = b.open_session()
    assert b.live_sessions() == live + 1
    b.prefill([s], [PROMPT])
    assert b.session_bytes(s) >= 40 * b.info.kv.full_bytes_per_token > 0
    t, _ = fresh(b, PROMPT[:20])
    b.decode([s, t], [1, 2])
    clone = b.clone(s, 41)
    assert b.session_bytes(clone) >= 41 * b.info.kv.full_bytes_per_token
    assert b.total_bytes() >= total + b.session_bytes(clone) + 40 * b.info.kv.full_bytes_per_token
    assert b.live_sessions() == live + 3
    release_all(b, s, t, clone)
    assert b.live_sessions() == live and b.total_bytes() == total


def test_bad_input_is_refused(backend):
    b = backend
    s = b.open_session()
    with pytest.raises(ValueError):
        b.prefill([s], [[b.info.vocab_size]])
    with pytest.raises(ValueError):
        b.prefill([s], [[]])
    b.prefill([s], [[5]])
    with pytest.raises(ValueError):
        b.decode([s, s], [1, 2])  # one session twice in a batch
    with pytest.raises(ValueError):
        b.prefill([s, s], [[1], [2]])
    assert s.position == 1
    b.release(s)
    with pytest.raises(ValueError):
        b.decode([s], [1])


def test_sliding_rule_at_every_position(backend):
    """Every donor position and cut point: served iff the rule says so (stated here
    independently of clone_refusal), and refusals leave the donor decoding as before."""
    b = backend
    windows = [layer.window for layer in b.info.layers if layer.kind == "sliding"]
    steps = prompt(2 * 16 + 4, seed=40)
    donor, _ = fresh(b, steps[:1])
    reference, _ = fresh(b, steps[:1])
    for position in range(1, len(steps)):
        for upto in range(-1, position + 2):
            allowed = 1 <= upto <= position and all(position <= w or upto >= position - 1 for w in windows)
            live, held = b.live_sessions(), b.session_bytes(donor)
            if allowed:
                b.release(b.clone(donor, upto))
            else:
                with pytest.raises(CloneRefused):
                    b.clone(donor, upto)
            assert (donor.position, b.session_bytes(donor), b.live_sessions()) == (position, held, live)
        # the same kernels on the same shapes: bit for bit
        np.testing.assert_array_equal(logits_np(b, b.decode([donor], [steps[position]])),
                                      logits_np(b, b.decode([reference], [steps[position]])))
    release_all(b, donor, reference)


@pytest.mark.numeric
def test_clone_at_l_minus_1_holds_one_position_less(backend):
    """A clone at L - 1 of a donor at L holds [L - W, L - 1): the donor's position L - 1
    sits where L - 1 - W would, so the clone can serve its own position but not one earlier."""
    b = backend
    donor, want = fresh(b, PROMPT)
    first = b.clone(donor, 39)
    if any(layer.kind == "sliding" for layer in b.info.layers):
        with pytest.raises(CloneRefused):
            b.clone(first, 38)
    second = b.clone(first, 39)
    assert_close(b, b.prefill([second], [PROMPT[39:]]), want, Kind.CLONE, context=40)
    release_all(b, donor, first, second)
