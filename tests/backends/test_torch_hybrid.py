"""The torch backend on hybrid models (Gated DeltaNet beside full attention): the two forms of
the delta rule, both checkpoint layouts, batched decode, and the recurrent clone rule.
Parity with mlx-lm itself is tests/backends/test_torch_hybrid_parity.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_fixtures import assert_close, lent, load
from kvfork.backends.base import CloneRefused, LayerAttention, ModelInfo, clone_positions, clone_refusal
from kvfork.backends.torch.backend import TorchBackend
from kvfork.backends.torch.gated_delta import chunked_delta_rule, delta_rule, l2_normalize, recurrent_delta_rule
from tiny_hybrid_models import HYBRID_ARCHS, LFM2
from tolerance import Kind, assert_arrays_close

DEVICE = os.environ.get("KVFORK_DEVICE", "cpu")


@pytest.fixture(params=HYBRID_ARCHS)
def hybrid(request, tiny_hybrid_dir) -> TorchBackend:
    """A loaded float32 backend (backend_fixtures.lent)."""
    yield from lent(request, ("torch", request.param, DEVICE),
                    lambda: load(TorchBackend(DEVICE), tiny_hybrid_dir(request.param)))


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def feed(b: TorchBackend, prompt: list[int], chunks=None):
    session, start = b.open_session(), 0
    for n in chunks or (len(prompt),):
        logits = b.prefill([session], [prompt[start : start + n]])
        start += n
    return session, b.to_numpy(logits)


def _rule_inputs(seed: int, b: int, t: int, heads: int, dk: int, dv: int):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(b, t, heads, dk, generator=g)) * dk**-0.5
    k = l2_normalize(torch.randn(b, t, heads, dk, generator=g))
    v = torch.randn(b, t, heads, dv, generator=g)
    log_decay = -torch.rand(b, t, heads, generator=g) * 0.5
    beta = torch.rand(b, t, heads, generator=g)
    state = torch.randn(b, heads, dk, dv, generator=g)
    return q, k, v, log_decay, beta, state


@pytest.mark.numeric
@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("t", [1, 37, 150])
def test_chunked_and_recurrent_forms_of_the_delta_rule_agree(chunk, t):
    """Same outputs and final state from any start state, with a ragged last chunk."""
    args = _rule_inputs(t, 2, t, 3, 16, 8)
    out_r, state_r = recurrent_delta_rule(*args)
    out_c, state_c = chunked_delta_rule(*args, chunk=chunk)
    # sums over a key (16), a chunk's tokens and the state's whole history (t)
    for got, want in ((out_c, out_r), (state_c, state_r)):
        assert_arrays_close(got.numpy(), want.numpy(), kind=Kind.FORMS, reductions=(16, min(chunk, t), t))


@pytest.mark.numeric
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's kernels need CUDA")
@pytest.mark.parametrize("chunked", [True, False])
def test_fla_kernels_agree_with_the_plain_forms(chunked):
    pytest.importorskip("fla")
    args = [x.cuda() for x in _rule_inputs(0, 2, 150, 4, 64, 64)]
    plain = (chunked_delta_rule if chunked else recurrent_delta_rule)(*args)
    kernel = delta_rule(*args, chunked=chunked)
    # fla's Triton kernels multiply float32 in TF32 on the tensor cores: its unit roundoff
    for got, want in zip(kernel, plain):
        assert_arrays_close(got.float().cpu().numpy(), want.cpu().numpy(), kind=Kind.FORMS, reductions=(64, 64, 150),
                            dtype="tfloat32")


@pytest.mark.numeric
def test_prefill_in_either_form_gives_the_same_logits(hybrid):
    prompt = tokens(1, 150)
    chunked_session, chunked = feed(hybrid, prompt, (70, 80))
    hybrid.model.set_chunked_prefill(False)
    try:
        recurrent_session, recurrent = feed(hybrid, prompt, (70, 80))
    finally:
        hybrid.model.set_chunked_prefill(True)
    assert_close(hybrid, chunked, recurrent, Kind.FORMS, context=150)
    hybrid.release(chunked_session)
    hybrid.release(recurrent_session)


@pytest.mark.numeric
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_both_layouts_load_to_the_same_model(arch, tiny_hybrid_dir):
    """Hugging Face (nested text_config, [C, 1, K] conv, zero-centred norms, vision and MTP
    weights skipped) and mlx-community (sanitized) folders of one model give one model."""
    prompt = tokens(2, 30)
    got = {}
    for layout in ("hf", "mlx"):
        b = load(TorchBackend(DEVICE), tiny_hybrid_dir(arch, layout))
        session, got[layout] = feed(b, prompt)
        b.release(session)
    assert_close(b, got["mlx"], got["hf"], Kind.FORMS, context=30)


def test_model_info_names_each_layer_and_counts_the_recurrent_state(hybrid):
    kinds = [layer.kind for layer in hybrid.info.layers]
    assert kinds == ["recurrent", "recurrent", "recurrent", "full"]
    session, _ = feed(hybrid, tokens(3, 10))
    full_kv = hybrid.session_bytes(session) - hybrid.info.kv.state_bytes
    assert hybrid.info.kv.state_bytes > 0
    assert full_kv == 256 * hybrid.info.kv.full_bytes_per_token  # one growth step of the full layer
    hybrid.release(session)


@pytest.mark.numeric
def test_batched_decode_of_four_sessions_equals_each_alone(hybrid):
    lengths = (1, 9, 40, 130)
    prompts = [tokens(10 + i, n) for i, n in enumerate(lengths)]
    together = [feed(hybrid, p)[0] for p in prompts]
    alone = [feed(hybrid, p)[0] for p in prompts]
    for step in range(4):
        step_tokens = tokens(100 + step, len(lengths))
        batched = hybrid.to_numpy(hybrid.decode(together, step_tokens))
        for row, (session, token) in enumerate(zip(alone, step_tokens)):
            assert_close(hybrid, batched[row], hybrid.to_numpy(hybrid.decode([session], [token]))[0], Kind.BATCHED,
                         context=lengths[row] + step + 1)
    for s in together + alone:
        hybrid.release(s)


def test_a_clone_at_the_position_is_exact_and_independent(hybrid):
    prompt, rest = tokens(4, 75), tokens(5, 6)
    donor, _ = feed(hybrid, prompt, (40, 35))
    clone = hybrid.clone(donor, 75)
    reference, _ = feed(hybrid, prompt, (40, 35))
    hybrid.decode([donor], [7])  # the donor moves on: the clone must not see it
    for token in rest:
        want = hybrid.to_numpy(hybrid.decode([reference], [token]))
        np.testing.assert_array_equal(hybrid.to_numpy(hybrid.decode([clone], [token])), want)
    for s in (donor, clone, reference):
        hybrid.release(s)


@pytest.mark.parametrize("upto", [1, 40, 74])
def test_a_clone_elsewhere_is_refused_and_changes_nothing(hybrid, upto):
    prompt, rest = tokens(6, 75), tokens(7, 5)
    donor, _ = feed(hybrid, prompt, (40, 35))
    twin, _ = feed(hybrid, prompt, (40, 35))
    live, held = hybrid.live_sessions(), hybrid.total_bytes()
    with pytest.raises(CloneRefused) as refused:
        hybrid.clone(donor, upto)
    assert refused.value.reason == "recurrent_position"
    assert (hybrid.live_sessions(), hybrid.total_bytes(), donor.position) == (live, held, 75)
    for token in rest:
        want = hybrid.to_numpy(hybrid.decode([twin], [token]))
        np.testing.assert_array_equal(hybrid.to_numpy(hybrid.decode([donor], [token])), want)
    hybrid.release(donor)
    hybrid.release(twin)


def _info(*kinds: LayerAttention) -> ModelInfo:
    return ModelInfo("m", 10, 100, kinds, (), 1, "float32", "cpu")


def test_clone_positions_state_the_rule():
    hybrid_info = _info(LayerAttention("recurrent"), LayerAttention("full"))
    assert list(clone_positions(9, hybrid_info)) == [9]
    assert list(clone_positions(0, hybrid_info)) == []
    assert list(clone_positions(3, _info(LayerAttention("full")))) == [1, 2, 3]
    assert clone_refusal(9, 9, hybrid_info, []) is None
    assert clone_refusal(9, 8, hybrid_info, []).reason == "recurrent_position"
    assert clone_refusal(9, 10, hybrid_info, []).reason == "beyond_position"


def test_torch_refuses_mamba_style_models_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LFM2))
    with pytest.raises(ValueError, match="MLX backend only"):
        TorchBackend("cpu").load(str(tmp_path))


def test_torch_refuses_a_quantized_conversion_clearly(tiny_hybrid_dir, tmp_path):
    folder = Path(tiny_hybrid_dir("qwen3_5", "mlx"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized"):
        TorchBackend("cpu").load(str(tmp_path))
