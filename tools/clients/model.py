"""The model `kvfork clients` serves: a tiny random llama with a 64k context.

It is a tiny llama (2 layers, hidden 64) with its context raised to 65,536 tokens, so Claude Code's
first request (about 20,000 tokens of system prompt and tools) fits and prefills in seconds on a CPU.
Its one head of 64 is a multiple of the default --kv-group-size (64), so the clients run at every
--kv-cache-dtype. Its tokenizer and chat template are the default model's (SmolLM2, fetched by
`kvfork fetch-model`): the tests' 512-token vocabulary would spell a client's English prompt out
nearly byte by byte, three times past the context.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

CONTEXT = 65536
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
             num_key_value_heads=1, head_dim=64)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def config(vocab_size: int, eos_token_id: int | list[int]) -> dict:
    return dict(SHAPE, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab_size,
                max_position_embeddings=CONTEXT, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                bos_token_id=None, eos_token_id=eos_token_id, hidden_act="silu", torch_dtype="float32")


def weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hugging Face llama names, scaled so logits are peaked."""
    rng = np.random.default_rng(seed)
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.normal(0.0, 1.0, (rows, cols)) / np.sqrt(cols)).astype(np.float32)

    out = {"model.embed_tokens.weight": rng.normal(0.0, 1.0, (v, h)).astype(np.float32),
           "model.norm.weight": (1.0 + rng.normal(0.0, 0.1, h)).astype(np.float32)}
    for n in range(cfg["num_hidden_layers"]):
        layer = f"model.layers.{n}."
        out |= {layer + "input_layernorm.weight": (1.0 + rng.normal(0.0, 0.1, h)).astype(np.float32),
                layer + "post_attention_layernorm.weight": (1.0 + rng.normal(0.0, 0.1, h)).astype(np.float32),
                layer + "self_attn.q_proj.weight": dense(q, h), layer + "self_attn.k_proj.weight": dense(kv, h),
                layer + "self_attn.v_proj.weight": dense(kv, h), layer + "self_attn.o_proj.weight": dense(h, q),
                layer + "mlp.gate_proj.weight": dense(i, h), layer + "mlp.up_proj.weight": dense(i, h),
                layer + "mlp.down_proj.weight": dense(h, i)}
    return out


def write_tiny_long_model(folder: Path, tokenizer_from: Path) -> Path:
    """Write the model into `folder` (once: one already there of this shape is kept); returns the folder."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    source = json.loads((Path(tokenizer_from) / "config.json").read_text())
    cfg = config(source["vocab_size"], source["eos_token_id"])
    written = folder / "config.json"
    if written.exists() and json.loads(written.read_text()) == cfg:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, folder / name)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = CONTEXT
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    save_file(weights(cfg), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))  # last: its presence means complete
    return folder
