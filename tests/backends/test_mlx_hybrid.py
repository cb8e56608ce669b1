"""MLX on hybrid models (Qwen3.5 dense and MoE, Qwen3-Next, LFM2, Nemotron-H, Granite 4 hybrid): recurrent layers
(`ArraysCache`) beside KV layers load in both checkpoint layouts, prefill and decode as mlx-lm's own
model call does, decode in the persistent batch exactly as alone, and clone by the recurrent rule
(base.clone_positions): exactly at the session's position, refused elsewhere with nothing changed (float32)."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core", exc_type=ImportError)
pytest.importorskip("mlx_lm", exc_type=ImportError)
from backend_fixtures import (assert_close, assert_greedy_close, continue_greedy, fresh, greedy, lent,  # noqa: E402
                              load, logits_np, prompt, release_all)
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from tiny_hybrid_models import HYBRID_ARCHS, LAYOUTS, MLX_ONLY_ARCHS  # noqa: E402
from tolerance import Kind  # noqa: E402

from kvfork.backends import create_backend  # noqa: E402
from kvfork.backends.mlx.last_token import supports_last_position  # noqa: E402
from kvfork.backends.base import BatchFailed, CloneRefused, RowState  # noqa: E402

ARCHS = (*HYBRID_ARCHS, *MLX_ONLY_ARCHS)


@pytest.fixture(params=ARCHS)
def hybrid(request, tiny_hybrid_dir):
    """A loaded float32 backend on one hybrid arch (backend_fixtures.lent)."""
    yield from lent(request, ("mlx", request.param), lambda: load("mlx", tiny_hybrid_dir(request.param)))


@pytest.mark.numeric
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_each_layout_and_runs_as_mlx_lm_does(arch, layout, tiny_hybrid_dir):
    if arch in MLX_ONLY_ARCHS and layout != "mlx":
        pytest.skip("written in mlx layout only")
    import mlx_lm

    folder = tiny_hybrid_dir(arch, layout)
    b = load("mlx", folder)
    info = b.info
    reference = mlx_lm.load(folder)[0]
    kinds = [layer.kind for layer in info.layers]
    assert set(kinds) == {"recurrent", "full"} and len(kinds) == len(make_prompt_cache(reference))
    assert info.kv.state_bytes > 0 and info.kv.full_bytes_per_token > 0
    assert supports_last_position(reference) == (arch != "nemotron_h")  # its inner model is a `backbone`
    tokens, forced = prompt(40, seed=1), prompt(5, seed=2)
    cache = make_prompt_cache(reference)
    want = np.array(reference(mx.array([tokens]), cache=cache)[0, -1])
    s, got = fresh(b, tokens, chunk=13)  # uneven chunks: the state carries across calls
    assert_close(b, logits_np(b, got)[0], want, Kind.CHUNKED, context=40)
    for t in forced:
        assert_close(b, logits_np(b, b.decode([s], [t]))[0], np.array(reference(mx.array([[t]]), cache=cache)[0, -1]),
                     Kind.CHUNKED, context=45)
    assert b.session_bytes(s) >= info.kv.state_bytes + 45 * info.kv.full_bytes_per_token
    b.release(s)
    assert b.total_bytes() == 0


def test_both_layouts_are_the_same_model(tiny_hybrid_dir):
    tokens = prompt(30, seed=3)
    rows = []
    for layout in LAYOUTS:  # sanitized to the same arrays: the same kernels on the same shapes
        b = load("mlx", tiny_hybrid_dir("qwen3_5", layout))
        s, logits = fresh(b, tokens)
        rows.append(logits_np(b, logits))
        b.release(s)
    np.testing.assert_array_equal(rows[0], rows[1])


@pytest.mark.numeric
def test_four_sessions_decode_together_as_each_alone(hybrid):
    """Rows of different lengths join, leave and rejoin the decode batch; every step's logits
    equal those of the same session decoding alone."""
    b = hybrid
    lengths, steps = (3, 9, 17, 30), 6
    prompts = [prompt(n, seed=20 + i) for i, n in enumerate(lengths)]
    alone = []
    for p in prompts:
        s, logits = fresh(b, p)
        alone.append(continue_greedy(b, s, logits, steps))
        b.release(s)
    sessions, logits = zip(*(fresh(b, p) for p in prompts))
    tokens = [greedy(b, lg)[0] for lg in logits]
    fed: list[list[int]] = [[] for _ in prompts]
    got: list[list[np.ndarray]] = [[] for _ in prompts]

    def step(rows: list[int]) -> None:
        out = logits_np(b, b.decode([sessions[i] for i in rows], [tokens[i] for i in rows]))
        for row, i in enumerate(rows):
            fed[i].append(tokens[i])
            got[i].append(out[row][None])
            tokens[i] = int(out[row].argmax())

    for n in range(steps):
        if n == 2:  # rows 0 and 2 leave the batch for a step alone each, then rejoin
            step([1, 3]), step([0]), step([2])
        else:
            step([0, 1, 2, 3])
    for i, want in enumerate(alone):  # each row's tokens were picked from the logits before them
        picked_from = [logits_np(b, logits[i]), *got[i][:-1]]
        assert_greedy_close(b, (fed[i], picked_from), want, Kind.BATCHED, context=lengths[i] + steps)
    release_all(b, *sessions)


@pytest.mark.numeric
@pytest.mark.parametrize("in_batch", [False, True])
def test_clone_at_the_position_is_exact_and_leaves_the_donor_as_it_was(hybrid, in_batch):
    b = hybrid
    tokens = prompt(25, seed=4)
    reference, logits = fresh(b, tokens)
    want = continue_greedy(b, reference, logits, 6)
    donor, logits = fresh(b, tokens[:-1])
    other, _ = fresh(b, prompt(7, seed=5))
    if in_batch:  # the donor's state is a row of the persistent decode batch
        logits = b.decode([donor, other], [tokens[-1], 3])[:1]
    else:
        logits = b.prefill([donor], [tokens[-1:]])
    clone = b.clone(donor, len(tokens))
    assert clone.position == len(tokens) and b.session_bytes(clone) >= b.info.kv.state_bytes
    for s in (clone, donor):  # each goes on as the reference did, neither seeing the other's writes
        assert_greedy_close(b, continue_greedy(b, s, logits, 6), want, Kind.CLONE, context=31)
    release_all(b, reference, donor, other, clone)


@pytest.mark.numeric
@pytest.mark.parametrize("in_batch", [False, True])
def test_clone_anywhere_else_is_refused_and_changes_nothing(hybrid, in_batch):
    b = hybrid
    tokens = prompt(20, seed=6)
    reference, logits = fresh(b, tokens)
    want = continue_greedy(b, reference, logits, 3)
    donor, logits = fresh(b, tokens[:-1])
    other, _ = fresh(b, prompt(7, seed=5))
    if in_batch:
        logits = b.decode([donor, other], [tokens[-1], 3])[:1]
    else:
        logits = b.prefill([donor], [tokens[-1:]])
    live, held, own = b.live_sessions(), b.total_bytes(), b.session_bytes(donor)
    for upto in (len(tokens) - 1, 8, 1):
        with pytest.raises(CloneRefused) as refused:
            b.clone(donor, upto)
        assert refused.value.reason == "recurrent_position"
    assert (b.live_sessions(), b.total_bytes(), b.session_bytes(donor)) == (live, held, own)
    assert_greedy_close(b, continue_greedy(b, donor, logits, 3), want, Kind.CHUNKED, context=23)
    release_all(b, reference, donor, other)


def test_session_bytes_count_the_recurrent_state(hybrid):
    b = hybrid
    empty = b.open_session()
    assert b.session_bytes(empty) == 0  # states come to be on the first call
    a, _ = fresh(b, prompt(10, seed=7))
    kv = b.session_bytes(a) - b.info.kv.state_bytes
    assert kv > 0 and kv % b.info.kv.full_bytes_per_token == 0  # whole KV slots beside one fixed state
    long, _ = fresh(b, prompt(300, seed=8))
    assert b.session_bytes(long) - b.info.kv.state_bytes >= 300 * b.info.kv.full_bytes_per_token
    b.decode([a, long], [5, 6])  # rows of the decode batch: each holds its state, and its KV padded
    assert b.total_bytes() >= 2 * b.info.kv.state_bytes + 2 * 301 * b.info.kv.full_bytes_per_token
    release_all(b, empty, a, long)
    assert b.total_bytes() == 0


@pytest.mark.numeric
@pytest.mark.parametrize("arch", ["lfm2"])  # its layers list is the one it runs
def test_a_decode_failure_is_classified_by_whether_a_state_moved(arch, tiny_hybrid_dir):
    """A step that fails in the first layer moved nothing: the sessions run again exactly. One that
    fails at the full-attention layer after the recurrent ones replaced their states is corrupt."""
    from test_batch_faults import failing_layer

    b = load("mlx", tiny_hybrid_dir(arch))
    prompts = [prompt(12, seed=30 + i) for i in range(3)]
    sessions = [fresh(b, p)[0] for p in prompts]
    b.decode(sessions, [5, 6, 7])  # a persistent decode batch
    with failing_layer(b, "mlx", 0, on_call=1), pytest.raises(BatchFailed) as failed:
        b.decode(sessions, [8, 9, 10])
    assert failed.value.rows == [RowState.UNTOUCHED] * 3
    again = logits_np(b, b.decode(sessions, [8, 9, 10]))
    for i, p in enumerate(prompts):
        s, want = fresh(b, p + [5 + i, 8 + i])
        assert_close(b, again[i], logits_np(b, want)[0], Kind.BATCHED, context=14)
        b.release(s)
    full = next(i for i, layer in enumerate(b.info.layers) if layer.kind == "full")
    assert full > 0
    with failing_layer(b, "mlx", full, on_call=1), pytest.raises(BatchFailed) as failed:
        b.decode(sessions, [1, 2, 3])
    assert failed.value.rows == [RowState.CORRUPT] * 3
    release_all(b, *sessions)


def test_a_model_with_state_kvfork_cannot_clone_is_refused_at_load(tmp_path):
    """Falcon-H1 nests a recurrent state and a KV cache in one `CacheList` per layer."""
    from tiny_hybrid_models import write_mlx_only_model

    config = dict(model_type="falcon_h1", architectures=["FalconH1ForCausalLM"], vocab_size=512, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                  mamba_d_conv=4, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
    folder = write_mlx_only_model(tmp_path / "falcon", config)
    with pytest.raises(ValueError, match="cannot clone"):
        create_backend("mlx").load(str(folder))


def test_keep_at_on_a_model_without_recurrent_layers_keeps_nothing(tiny_model_dir):
    b = create_backend("mlx")
    b.load(tiny_model_dir("llama"), "float32")
    s, _ = fresh(b, prompt(12))
    bytes_before = b.session_bytes(s)
    b.keep_at(s, [5, 12])
    assert s.kept == () and b.session_bytes(s) == bytes_before
    b.release(s)


@pytest.mark.parametrize("arch", ["lfm2"])  # its layers list is the one it runs
def test_a_prefill_that_fails_keeps_no_checkpoint(arch, tiny_hybrid_dir):
    """A chunk split at a checkpoint that fails in its second piece has moved the state: corrupt,
    and the state taken at the split is not kept. One failing before any layer ran is untouched."""
    from test_batch_faults import failing_layer

    b = create_backend("mlx")
    b.load(tiny_hybrid_dir(arch), "float32")
    tokens = prompt(20, seed=11)
    s = b.open_session()
    b.keep_at(s, [8])
    with failing_layer(b, "mlx", 0, on_call=1), pytest.raises(BatchFailed) as failed:
        b.prefill([s], [tokens])
    assert failed.value.rows == [RowState.UNTOUCHED] and (s.position, s.kept) == (0, ())
    with failing_layer(b, "mlx", 0, on_call=2), pytest.raises(BatchFailed) as failed:
        b.prefill([s], [tokens])
    assert failed.value.rows == [RowState.CORRUPT] and (s.position, s.kept) == (0, ())
    b.release(s)


@pytest.mark.numeric
def test_a_quantized_hybrid_loads_clones_and_generates(tiny_hybrid_dir, tmp_path):
    """mlx-lm's own converter, 4-bit: the recurrent layers' projections packed, their states float."""
    from mlx_lm.convert import convert

    out = tmp_path / "qwen3_5-q4"
    convert(tiny_hybrid_dir("qwen3_5", "hf"), str(out), quantize=True, q_bits=4, q_group_size=32)
    b = load("mlx", str(out), None)
    info = b.info
    assert "quantization" in (out / "config.json").read_text() and info.kv.state_bytes > 0
    tokens = prompt(20, seed=12)
    reference, want = fresh(b, tokens)
    donor, got = fresh(b, tokens, chunk=7)
    assert_close(b, got, want, Kind.CHUNKED, context=20)
    clone = b.clone(donor, len(tokens))
    assert_greedy_close(b, continue_greedy(b, clone, got, 5), continue_greedy(b, reference, want, 5), Kind.CLONE,
                        context=25)
    assert np.isfinite(logits_np(b, want)).all()
    release_all(b, reference, donor, clone)
