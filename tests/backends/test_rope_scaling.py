"""RoPE scaling: the torch backend's frequencies and attention factor are transformers' own, its logits
are transformers' model's, and MLX (mlx-lm's rope classes) gives the same greedy tokens; dynamic NTK is
refused on every backend."""

from __future__ import annotations

import math

import pytest
import torch
from backend_fixtures import continue_greedy, fresh, load, logits_np, model_of, prompt, release_all
from tiny_models import write_model
from tolerance import Kind, assert_arrays_close, assert_logits_close, assert_same_greedy

from kvfork.backends import create_backend
from kvfork.backends.model_info import model_facts
from kvfork.backends.torch.config import parse_config
from kvfork.backends.torch.rope import angles, inverse_frequencies

HALF = 8  # the tiny models' head_dim / 2
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    # an original context below the test prompts: transformers then uses the long factors, as kvfork always does
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 32,
                 "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
                 "long_factor": [1.0 + 0.7 * i for i in range(HALF)]},
}


def _config(arch: str, scaling: dict) -> dict:
    from tiny_models import CONFIGS

    return dict(CONFIGS[arch], rope_scaling=scaling)


@pytest.mark.parametrize("kind", SCALINGS)
def test_frequencies_and_attention_factor_are_transformers(kind):
    """cos and sin (attention factor included) equal transformers' rotary embedding's, at a length past the
    original context (where transformers uses LongRoPE's long factors, as kvfork does at every length)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _config("llama", SCALINGS[kind])
    reference = LlamaRotaryEmbedding(LlamaConfig(**config))
    positions = torch.arange(1100)[None]
    want_cos, want_sin = reference(torch.zeros(1, 1, 16), positions)
    rope = parse_config(config).rope_full
    inv_freq, scale = inverse_frequencies(rope, 16)
    assert (scale != 1.0) == (kind in ("yarn", "longrope"))
    # The attention factor, a formula of the scaling factor and the lengths: a few roundings, no sum.
    assert_arrays_close(scale, reference.attention_scaling, kind=Kind.FORMS, reductions=(1,), each=True)
    # Each frequency apart, a power of theta: its exponent's rounding amplified by at most ln(theta).
    assert_arrays_close(inv_freq.numpy(), reference.inv_freq.numpy(), kind=Kind.FORMS, reductions=(1,), each=True,
                        condition=math.log(rope.theta))
    cos, sin = angles(positions, inv_freq, scale)
    # An angle carries its frequency's rounding times its size: cos and sin amplify it by the largest angle.
    largest = float(positions.max() * inv_freq.max())
    for got, want in ((cos[0, :, 0], want_cos[0, :, :HALF]), (sin[0, :, 0], want_sin[0, :, :HALF])):
        assert_arrays_close(got.numpy(), want.numpy(), kind=Kind.FORMS, reductions=(1,), condition=largest)


@pytest.fixture(scope="module", params=[("llama", k) for k in SCALINGS] + [("qwen3", "yarn")],
                ids=lambda p: "-".join(p))
def scaled_model(request, tmp_path_factory):
    arch, kind = request.param
    return str(write_model(tmp_path_factory.mktemp(f"{arch}-{kind}"), arch, rope_scaling=SCALINGS[kind]))


@pytest.mark.numeric
def test_torch_logits_are_transformers_model(scaled_model):
    from transformers import AutoModelForCausalLM

    tokens = prompt(48)
    reference = AutoModelForCausalLM.from_pretrained(scaled_model, dtype=torch.float32)
    with torch.no_grad():
        want = reference(torch.tensor([tokens])).logits[0, -1:].numpy()
    b = load("torch", scaled_model)
    session, got = fresh(b, tokens)
    assert_logits_close(logits_np(b, got), want, kind=Kind.FORMS, model=model_of(b), context=len(tokens))
    release_all(b, session)


@pytest.mark.numeric
def test_mlx_and_torch_give_the_same_greedy_tokens(scaled_model):
    pytest.importorskip("mlx_lm")
    answers = []
    for name in ("mlx", "torch"):
        b = load(name, scaled_model)
        session, logits = fresh(b, prompt(40))
        answers.append(continue_greedy(b, session, logits, 12))
        release_all(b, session)
    assert_same_greedy(answers[0], answers[1], kind=Kind.BACKENDS, model=model_of(b), context=52)


DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}


def test_dynamic_ntk_is_refused_for_every_backend(tmp_path):
    with pytest.raises(ValueError, match="'dynamic' .* rescales every position's frequencies as the sequence grows"):
        model_facts(_config("llama", DYNAMIC))
    with pytest.raises(ValueError, match="dynamic"):  # also nested per layer kind (transformers 5)
        model_facts({"rope_parameters": {"full_attention": DYNAMIC, "sliding_attention": {"rope_type": "default"}}})
    folder = str(write_model(tmp_path / "dynamic", "llama", rope_scaling=DYNAMIC))
    for name in ("torch", "mlx"):
        if name == "mlx":
            pytest.importorskip("mlx_lm")
        with pytest.raises(ValueError, match="kvfork refuses it"):
            create_backend(name).load(folder, "float32")


def test_torch_refuses_a_scaling_it_does_not_know():
    with pytest.raises(ValueError, match="rope scaling 'su' is not one the torch backend serves"):
        parse_config(_config("llama", {"type": "su", "factor": 2.0}))
