"""The error model of tolerance.py is a bound that can fail: for each kind of comparison, the right
path holds within it and a deliberately wrong path (RoPE one position off, one KV row dropped, a
recurrent state one step stale) is caught, by at least `CAUGHT_BY` times the bound."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backend_fixtures import fresh, lent, load, logits_np, model_of, prompt, release_all
from kvfork.backends.base import SavedLayer, SavedState
from kvfork.backends.torch import attention
from kvfork.backends.torch.backend import TorchBackend
import tolerance
from tolerance import (Kind, Model, assert_dequantized_close, assert_grouped_close, assert_logits_close,
                       assert_logprobs_close, assert_same_greedy, bound, top_two_margin)

# A wrong path must miss by this many bounds at least: a bound loosened tenfold still catches each.
CAUGHT_BY = 10


def ratio(b, got, want, context: int) -> float:
    """The largest difference of two logits arrays against its bound (> 1: outside)."""
    got, want = logits_np(b, got), logits_np(b, want)
    return float(np.abs(got - want).max() / bound(np.abs(want).max(), model_of(b).reductions(context)))


def check(b, right, wrong, want, kind: Kind, context: int) -> None:
    """`right` holds within the bound of `want`, and `wrong` misses it by CAUGHT_BY bounds or more."""
    assert_logits_close(logits_np(b, right), logits_np(b, want), kind=kind, model=model_of(b), context=context)
    with pytest.raises(AssertionError, match=kind.value):
        assert_logits_close(logits_np(b, wrong), logits_np(b, want), kind=kind, model=model_of(b), context=context)
    assert ratio(b, wrong, want, context) >= CAUGHT_BY


def shifted(b: TorchBackend, rows: slice | int):
    """A forward pre-hook that rotates the tokens at `rows` of the pass one position on (RoPE off by one)."""
    def hook(module, args):
        tokens, positions, row_info = args
        positions = positions.clone()
        positions[rows] += 1
        return tokens, positions, row_info
    return b.model.register_forward_pre_hook(hook)


@pytest.fixture
def llama(request, tiny_model_dir) -> TorchBackend:
    """The llama test model on torch's CPU path (backend_fixtures.lent)."""
    yield from lent(request, ("torch", "llama", "cpu"), lambda: load(TorchBackend("cpu"), tiny_model_dir("llama")))


@pytest.mark.numeric
def test_batched_rows_against_each_alone(llama):
    """Four sessions decode together; one row rotated one position off is caught."""
    b, lengths = llama, (5, 12, 23, 37)
    sessions = [fresh(b, prompt(n, seed=i))[0] for i, n in enumerate(lengths)]
    singles, alone = zip(*(fresh(b, prompt(n, seed=i) + [7]) for i, n in enumerate(lengths)))
    handle = shifted(b, 2)
    wrong = logits_np(b, b.decode(sessions, [7] * 4))
    handle.remove()
    twins = [fresh(b, prompt(n, seed=i))[0] for i, n in enumerate(lengths)]
    right = logits_np(b, b.decode(twins, [7] * 4))
    for row in (0, 1, 3):  # the rows the hook left alone
        assert_logits_close(wrong[row], logits_np(b, alone[row])[0], kind=Kind.BATCHED, model=model_of(b), context=38)
    check(b, right[2:3], wrong[2:3], alone[2], Kind.BATCHED, context=24)
    release_all(b, *sessions, *twins, *singles)


@pytest.mark.numeric
def test_torch_against_mlx_lm(llama, tiny_model_dir):
    """torch against mlx-lm's own model call; a decode step rotated one position off is caught."""
    mx = pytest.importorskip("mlx.core", exc_type=ImportError)
    mlx_lm = pytest.importorskip("mlx_lm", exc_type=ImportError)
    from mlx_lm.models.cache import make_prompt_cache

    b, tokens = llama, prompt(40, seed=3)
    reference = mlx_lm.load(tiny_model_dir("llama"))[0]
    cache = make_prompt_cache(reference)
    reference(mx.array([tokens]), cache=cache)
    want = np.array(reference(mx.array([[9]]), cache=cache)[:, -1])
    s, _ = fresh(b, tokens)
    twin, _ = fresh(b, tokens)
    right = b.decode([s], [9])
    handle = shifted(b, slice(None))
    wrong = b.decode([twin], [9])
    handle.remove()
    check(b, right, wrong, want, Kind.BACKENDS, context=41)
    release_all(b, s, twin)


@pytest.mark.numeric
def test_shared_blocks_against_a_contiguous_session(llama, monkeypatch):
    """A clone decoding over the donor's blocks (two runs of keys) against a cold session; reading the
    shared run one row short is caught."""
    b, tokens = llama, prompt(700, seed=4)
    donor, _ = fresh(b, tokens)
    clone, twin = b.clone(donor, 700), b.clone(donor, 700)
    assert len(clone.table.reads) == 1  # it reads the donor's whole blocks in place
    cold, want = fresh(b, tokens + [11])
    right = b.decode([clone], [11])
    real = attention.partial
    monkeypatch.setattr(attention, "partial",
                        lambda grouped, runs, scale, storage: real(
                            grouped, [(k[:, 1:], v[:, 1:]) for k, v in runs[:1]] + runs[1:], scale, storage))
    wrong = b.decode([twin], [11])
    monkeypatch.undo()
    check(b, right, wrong, want, Kind.BLOCKS, context=701)
    release_all(b, donor, clone, twin, cold)


@pytest.mark.numeric
@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_a_clone_against_a_fresh_prefill(backend_name, tiny_model_dir):
    """A clone at 30 with the prompt's tail against the whole prompt prefilled; a clone that lost its
    prefix's last KV row (cut at 29, the tail after 30) is caught."""
    pytest.importorskip(f"{backend_name}")
    b, tokens = load(backend_name, tiny_model_dir("qwen3")), prompt(45, seed=5)
    donor, _ = fresh(b, tokens[:30])
    reference, want = fresh(b, tokens)
    right_clone, wrong_clone = b.clone(donor, 30), b.clone(donor, 29)
    right, wrong = b.prefill([right_clone], [tokens[30:]]), b.prefill([wrong_clone], [tokens[30:]])
    check(b, right, wrong, want, Kind.CLONE, context=45)
    release_all(b, donor, reference, right_clone, wrong_clone)


@pytest.mark.numeric
@pytest.mark.parametrize("backend_name", ["torch", "mlx"])
def test_a_state_restored_from_disk_against_recomputing_it(backend_name, tiny_model_dir):
    """A prompt's state written to the disk tier's format and read back, less its last token (as the engine
    restores a hit), which is then prefilled on it, against the whole prompt prefilled; the file missing
    one KV row (a middle one) is caught."""
    from kvfork.server.engine.cache.disk import decode, encode

    pytest.importorskip(backend_name)
    b, tokens = load(backend_name, tiny_model_dir("llama")), prompt(60, seed=6)
    saved, _ = fresh(b, tokens[:59])
    state, _, _ = decode(encode(b.export_state(saved), tokens[:59], "a scope's digest", "fp"), "fp")
    reference, want = fresh(b, tokens)
    drop = lambda a: np.delete(a, 25, axis=1)  # [kv_heads, tokens, head_dim]: token 25 gone
    short = SavedState(58, tuple(SavedLayer(layer.kind, tuple(drop(a) for a in layer.arrays), layer.first)
                                 for layer in state.layers))
    right_session, wrong_session = b.import_state(state), b.import_state(short)
    right, wrong = b.prefill([right_session], [tokens[59:]]), b.prefill([wrong_session], [tokens[59:]])
    check(b, right, wrong, want, Kind.DISK, context=60)
    release_all(b, saved, reference, right_session, wrong_session)


@pytest.mark.numeric
def test_a_checkpoint_against_running_from_the_start(tiny_hybrid_dir):
    """A hybrid clone from a recurrent checkpoint at 24 against the whole prompt; a checkpoint whose
    recurrent states are one step stale (those of 23, beside the KV of 24) is caught."""
    b, tokens = load(TorchBackend("cpu"), tiny_hybrid_dir("qwen3_5")), prompt(40, seed=7)
    s = b.open_session()
    b.keep_at(s, [24])
    b.prefill([s], [tokens[:32]])
    clone = b.clone(s, 24)
    early, _ = fresh(b, tokens[:23])
    at, before = b.export_state(clone), b.export_state(early)
    stale = SavedState(24, tuple(old if layer.kind == "recurrent" else layer
                                 for layer, old in zip(at.layers, before.layers)))
    stale_session = b.import_state(stale)
    reference, want = fresh(b, tokens)
    right, wrong = b.prefill([clone], [tokens[24:]]), b.prefill([stale_session], [tokens[24:]])
    check(b, right, wrong, want, Kind.CHECKPOINT, context=40)
    release_all(b, s, clone, early, stale_session, reference)


@pytest.mark.numeric
def test_the_same_greedy_tokens_allow_a_flip_at_a_near_tie_only(monkeypatch):
    monkeypatch.setattr(tolerance, "worst", {})  # made-up logits: kept out of the run's report
    monkeypatch.setattr(tolerance, "closest_tie", [math.inf, ""])
    model = Model(hidden=64, ffn=128, layers=2)
    peaked = np.array([[0.0, 5.0, 1.0, 2.0]])
    allowed = bound(5.0, model.reductions(10))
    tie = np.array([[0.0, 5.0, 5.0 - allowed / 2, 2.0]])  # a top-two margin within twice the bound
    assert top_two_margin(tie) < 2 * allowed < top_two_margin(peaked)
    assert assert_same_greedy(([1, 3], [peaked, peaked]), ([1, 3], [peaked, peaked]), kind=Kind.CLONE, model=model,
                              context=10) == 2
    # at a near tie the other token is a right answer too, and the paths part there
    assert assert_same_greedy(([2, 0], [tie, tie]), ([1, 3], [tie, peaked]), kind=Kind.CLONE, model=model,
                              context=10) == 0
    with pytest.raises(AssertionError, match="top-two margin"):
        assert_same_greedy(([1, 2], [peaked, peaked]), ([1, 3], [peaked, peaked]), kind=Kind.CLONE, model=model,
                           context=10)
    with pytest.raises(AssertionError, match="clone vs fresh prefill"):  # the logits are checked too
        assert_same_greedy(([1], [peaked + 0.01]), ([1], [peaked]), kind=Kind.CLONE, model=model, context=10)


def test_the_bound_grows_with_the_sums_and_the_magnitude(tiny_model_dir, tiny_hybrid_dir):
    llama, hybrid = Model.of(tiny_model_dir("llama")), Model.of(tiny_hybrid_dir("qwen3_5_moe"))
    assert (llama.hidden, llama.ffn, llama.layers) == (64, 128, 2)
    assert (hybrid.hidden, hybrid.ffn, hybrid.layers) == (64, 128, 4)  # the nested text config's
    short, long = bound(1.0, llama.reductions(40)), bound(1.0, llama.reductions(1000))
    assert short < long < 3 * short and bound(30.0, llama.reductions(40)) == pytest.approx(30 * short)
    assert bound(1.0, llama.reductions(40)) < bound(1.0, hybrid.reductions(40))
    assert bound(1.0, (64,), "bfloat16") > 1000 * bound(1.0, (64,))
    # float32: about 3e-5 of max |logit| for the llama test model at 40 tokens
    assert 1e-5 < short < 1e-4


def test_logprobs_and_dequantized_weights_catch_a_wrong_path():
    """A float32 log-softmax holds against float64, one missing its largest term from the normaliser is
    caught; a Q8_0 grid holds against the weights it rounds, one value two steps off is caught."""
    rows = np.random.default_rng(0).standard_normal((2, 512)) * 8
    exact = rows - rows.max(-1, keepdims=True)
    exact -= np.log(np.exp(exact).sum(-1, keepdims=True))
    single = rows.astype(np.float32) - rows.max(-1, keepdims=True).astype(np.float32)
    single -= np.log(np.exp(single).sum(-1, keepdims=True))
    assert_logprobs_close(single, exact, vocab=512)
    short = np.sort(exact, -1)[:, :-1]
    with pytest.raises(AssertionError, match="logprobs"):
        assert_logprobs_close(short - np.log(np.exp(short).sum(-1, keepdims=True)), short, vocab=512)
    weights = rows[:, :64]
    step = np.abs(weights.reshape(2, 2, 32)).max(-1, keepdims=True) / 127
    grid = (np.round(weights.reshape(2, 2, 32) / step) * step).reshape(weights.shape)
    assert_dequantized_close(grid, weights, "Q8_0")
    grid[0, 5] += 2 * step[0, 0, 0]
    with pytest.raises(AssertionError, match="Q8_0"):
        assert_dequantized_close(grid, weights, "Q8_0")


def test_grouped_kv_catches_a_value_a_step_off():
    """An int4 grid in groups of 32 (the nearest of 15 steps from the group's minimum) holds against what it
    rounds, within half a step; one value two steps off is caught (and, to the grid, three steps off)."""
    x = np.random.default_rng(1).standard_normal((4, 64)) * np.linspace(0.1, 30, 64)
    groups = x.reshape(4, 2, 32)
    low, step = groups.min(-1, keepdims=True), np.ptp(groups, -1, keepdims=True) / 15
    grid = (np.round((groups - low) / step) * step + low).reshape(x.shape)
    assert_grouped_close(grid, x, bits=4, group=32)
    grid[2, 40] += 2 * step[2, 1, 0]
    with pytest.raises(AssertionError, match="int4"):
        assert_grouped_close(grid, x, bits=4, group=32)
    grid[2, 40] += step[2, 1, 0]
    with pytest.raises(AssertionError, match="int4"):
        assert_grouped_close(grid, x, bits=4, group=32, to_grid=True)
