"""MLX only: quantized models (made with mlx-lm's own converter) load, clone
exactly and generate; an all-recurrent model (Mamba) loads (hybrids: test_mlx_hybrid.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from backend_fixtures import assert_close, assert_greedy_close, continue_greedy, fresh, load, logits_np, prompt
from tolerance import Kind

pytest.importorskip("mlx_lm")

from kvfork.backends import create_backend  # noqa: E402
from kvfork.backends.base import CloneRefused  # noqa: E402


@pytest.fixture(scope="module")
def quantized_dir(tiny_model_dir, tmp_path_factory):
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("quantized") / "llama-q4"
    convert(tiny_model_dir("llama"), str(out), quantize=True, q_bits=4, q_group_size=32)
    return str(out)


@pytest.mark.numeric
def test_quantized_model_loads_clones_and_generates(quantized_dir):
    b = load("mlx", quantized_dir, None)
    info = b.info
    assert info.dtype == "float32" and info.vocab_size == 512
    assert "quantization" in Path(quantized_dir, "config.json").read_text()
    tokens = prompt(30)
    reference, want = fresh(b, tokens)
    want_greedy = continue_greedy(b, reference, want, 6)
    donor, _ = fresh(b, tokens[:20])
    clone = b.clone(donor, 20)
    got = b.prefill([clone], [tokens[20:]])
    assert_greedy_close(b, continue_greedy(b, clone, got, 6), want_greedy, Kind.CLONE, context=36)
    assert np.isfinite(logits_np(b, got)).all()
    for s in (reference, donor, clone):
        b.release(s)
    assert b.live_sessions() == 0 and b.total_bytes() == 0


def test_an_all_recurrent_model_loads_and_clones_at_its_position_only(tmp_path, tiny_model_dir):
    """Mamba: every layer keeps recurrent state and no KV (the recurrent rule, base.clone_positions)."""
    import json
    import shutil

    folder = tmp_path / "mamba"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mamba", architectures=["MambaForCausalLM"], state_size=4, conv_kernel=4,
                  expand=2, time_step_rank=4, use_bias=False, use_conv_bias=True)
    (folder / "config.json").write_text(json.dumps(config))
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from safetensors.numpy import save_file

    model_cls, args_cls = _get_classes(config)
    weights = {k: np.asarray(v) for k, v in tree_flatten(model_cls(args_cls.from_dict(config)).parameters())}
    save_file(weights, str(folder / "model.safetensors"))
    b = load("mlx", str(folder))
    info = b.info
    assert {layer.kind for layer in info.layers} == {"recurrent"} and info.kv.full_bytes_per_token == 0
    tokens = prompt(12)
    reference, want = fresh(b, tokens)
    donor, _ = fresh(b, tokens)
    with pytest.raises(CloneRefused, match="recurrent_position"):
        b.clone(donor, 11)
    clone = b.clone(donor, 12)
    # the same kernels on the same shapes: bit for bit
    got, expected = continue_greedy(b, clone, want, 4), continue_greedy(b, reference, want, 4)
    assert got[0] == expected[0]
    np.testing.assert_array_equal(np.array(got[1]), np.array(expected[1]))
    for s in (reference, donor, clone):
        b.release(s)


def test_dtype_choice_and_missing_folder(tiny_model_dir):
    tokens = prompt(20)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        b = create_backend("mlx")
        assert b.load(tiny_model_dir("qwen3"), dtype).dtype == dtype
        s, logits = fresh(b, tokens)
        rows[dtype] = logits_np(b, logits)
        b.release(s)
    assert rows["bfloat16"].dtype == np.float32
    assert rows["bfloat16"].argmax() == rows["float32"].argmax()
    with pytest.raises(FileNotFoundError, match="no model folder"):
        create_backend("mlx").load("/nonexistent/model")
    with pytest.raises(ValueError, match="unsupported dtype"):
        create_backend("mlx").load(tiny_model_dir("qwen3"), "int8")


@pytest.mark.numeric
def test_prefill_logits_equal_the_plain_model_call(arch, tiny_model_dir):
    """Prefill projects only the last position; it must give mlx-lm's own last row."""
    import mlx.core as mx

    b = load("mlx", tiny_model_dir(arch), None)
    assert b._last_only
    tokens = prompt(33)
    s, logits = fresh(b, tokens, chunk=10)
    plain = b.model(mx.array([tokens]))[:, -1]
    assert_close(b, logits, np.array(plain), Kind.CHUNKED, context=33)
    b.release(s)
