"""Tiny random models written at test time: Hugging Face folders both backends load.

Each folder holds config.json, model.safetensors (float32), tokenizer.json and
tokenizer_config.json with a ChatML template. Weights are scaled so logits are
peaked: near-ties would flip greedy tokens and make equality tests flaky.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_WORDS = (
    "the a an of to in is was for on that with as by at from it this be are or have "
    "system user assistant tool call result function name arguments read write file "
    "search code test model cache prefix token prompt request server answer question "
    "capital France Paris Berlin Germany city river mountain number value error list "
    "open close start stop run send time first last next long short shared agent"
).split()

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=2,
    torch_dtype="float32",
)

CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2),
    "qwen3": dict(_COMMON, model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=2),
    "gemma3": dict(
        _COMMON,
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=3,
        sliding_window=16,
        sliding_window_pattern=3,  # layers 0, 1 slide; layer 2 is full
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        rope_local_base_freq=10000.0,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    ),
}
ARCHS = tuple(CONFIGS)
# The default model's widths (SmolLM2-135M: hidden 576, 9 heads of 64 over 3 key heads, MLP 1536), for random
# weights at a real model's sizes (write_model(folder, "llama", **REAL_WIDTHS)): the kernels' order of summation
# changes with the shapes a pass gives them at these widths, which the tiny ones hide.
REAL_WIDTHS = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)

# The long tests' llama: one layer and narrow heads, so attention over 128k tokens stays affordable on two
# cores (write_model(folder, "llama", **LONG_CONTEXT)).
LONG_CONTEXT = dict(max_position_embeddings=131_072, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)


def corpus(seed: int = 0, lines: int = 400) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        words = rng.choice(_WORDS, size=int(rng.integers(4, 16)))
        out.append(" ".join(words) + f" {int(rng.integers(0, 10_000))}.")
    return out


def build_tokenizer(vocab_size: int, specials: tuple[str, ...] = ()):
    """A BPE tokenizer trained on the corpus; `specials` are special tokens after the ChatML ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def _parameter_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The HF parameter names and shapes, from mlx-lm's model class where MLX is installed,
    else from the torch backend's (GPU machines run the torch tests without MLX)."""
    try:
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.utils import _get_classes
    except ImportError:
        import torch

        from kvfork.backends.torch.config import parse_config
        from kvfork.backends.torch.model import Transformer

        with torch.device("meta"):
            model = Transformer(parse_config(config), tied=config["tie_word_embeddings"])
        return [(name, tuple(p.shape)) for name, p in model.state_dict().items()]
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    shapes = [(name, tuple(p.shape)) for name, p in tree_flatten(model.parameters())]
    del model
    mx.clear_cache()
    return shapes


def _weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random weights with the parameter names and shapes the model has (the HF names)."""
    rng = np.random.default_rng(seed)
    out = {}
    gemma = config["model_type"].startswith("gemma")
    for name, shape in _parameter_shapes(config):
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue  # gemma's class always has one; a tied checkpoint carries none
        if name.endswith("norm.weight"):
            # gemma norms scale by (1 + w): zero-centred; others scale by w.
            w = rng.normal(0.0, 0.1, shape) + (0.0 if gemma else 1.0)
        elif name.endswith("embed_tokens.weight"):
            w = rng.normal(0.0, 1.0, shape)
        else:
            w = rng.normal(0.0, 1.0, shape) / np.sqrt(shape[-1])
        out[name] = w.astype(np.float32)
    return out


def write_model(folder: Path, arch: str, seed: int = 0, **changes) -> Path:
    """Write a tiny `arch` model into `folder`, its config with `changes`; returns the folder."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[arch], **changes)
    config["eos_token_id"] = write_tokenizer(folder, config["vocab_size"], config["max_position_embeddings"])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_weights(config, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def write_tokenizer(folder: Path, vocab_size: int, max_positions: int) -> int:
    """The tokenizer files of a tiny model (ChatML); returns the EOS id (<|im_end|>)."""
    tok = build_tokenizer(vocab_size)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": CHATML,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": max_positions,
            },
            indent=2,
        )
    )
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return tok.token_to_id("<|im_end|>")
