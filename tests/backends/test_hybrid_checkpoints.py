"""keep_at on both backends (float32): recurrent states kept inside one prefill chunk (split there)
and at a decode step serve exact clones after the session moved on; other positions stay refused;
each checkpoint costs kv.state_bytes, and dropping it frees them."""

from __future__ import annotations

import pytest

from backend_fixtures import (assert_greedy_close, backend_name, continue_greedy, fresh, greedy,  # noqa: F401
                              lent, load, prompt, release_all)
from kvfork.backends.base import CloneRefused
from tiny_hybrid_models import HYBRID_ARCHS, MLX_ONLY_ARCHS
from tolerance import Kind


@pytest.fixture(params=(*HYBRID_ARCHS, *MLX_ONLY_ARCHS))
def hybrid(request, backend_name, tiny_hybrid_dir):  # noqa: F811
    """A loaded float32 backend on one hybrid arch (backend_fixtures.lent)."""
    if backend_name == "torch" and request.param in MLX_ONLY_ARCHS:
        pytest.skip("a family only MLX serves")
    yield from lent(request, (backend_name, request.param),
                    lambda: load(backend_name, tiny_hybrid_dir(request.param)))


def assert_costs(b, got: int, want: int) -> None:
    """The backend's count against its published KVCost: exact, or within the tolerance it states."""
    kv = b.info.kv
    slack = kv.tolerance * want + (kv.step * kv.full_bytes_per_token if kv.tolerance else 0)
    assert abs(got - want) <= slack, (got, want)


@pytest.mark.numeric
def test_checkpoints_serve_exact_clones_behind_the_position(hybrid):
    b = hybrid
    tokens = prompt(30, seed=9)
    s = b.open_session()
    b.keep_at(s, [10, 20, 33])
    assert s.kept == ()
    logits = b.prefill([s], [tokens])  # one chunk: the checkpoints at 10 and 20 fall inside it
    assert s.kept == (10, 20)
    other, _ = fresh(b, prompt(5, seed=10))
    fed = []
    for _ in range(3):  # decoded beside another session; the state at 33 is kept at its step
        fed.append(greedy(b, logits)[0])
        logits = b.decode([s, other], [fed[-1], 4])[:1]
    assert s.kept == (10, 20, 33)
    assert_costs(b, b.session_bytes(s), b.info.kv.bytes_for(33, checkpoints=3))
    for upto, history in ((10, tokens[:10]), (20, tokens[:20]), (33, tokens + fed)):
        clone = b.clone(s, upto)
        assert_costs(b, b.session_bytes(clone), b.info.kv.bytes_for(upto, start=upto))
        tail = prompt(4, seed=upto)
        reference, want = fresh(b, history + tail)
        got = b.prefill([clone], [tail])
        assert_greedy_close(b, continue_greedy(b, clone, got, 3), continue_greedy(b, reference, want, 3),
                            Kind.CHECKPOINT, context=len(history) + 7)
        release_all(b, clone, reference)
    for upto in (9, 15, 32):
        with pytest.raises(CloneRefused, match="recurrent_position"):
            b.clone(s, upto)
    before = b.session_bytes(s)
    b.keep_at(s, [20])  # the others are released
    assert s.kept == (20,) and b.session_bytes(s) == before - 2 * b.info.kv.state_bytes
    with pytest.raises(CloneRefused):
        b.clone(s, 10)
    b.keep_at(s, [s.position])  # kept at once: the session is there now
    assert s.kept == (s.position,)
    release_all(b, s, other)
    assert b.total_bytes() == 0
