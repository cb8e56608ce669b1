"""Convert a llama GGUF into a Hugging Face folder (float32) that mlx-lm and our torch backend load.

Route: `mx.load` reads tensors and metadata in well under a second; we
dequantize in float32 and undo llama.cpp's q/k permutation (~2 s in all on
2 cores). transformers' own GGUF loader gives the same weights but needs
`accelerate` and took ~43 s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from kvfork.backends.gguf.tokenizer import build_tokenizer, special_token_ids, tokenizer_config
from kvfork.backends.gguf.weights import hf_llama_weights

# Bump whenever the converted folder would differ: cached folders with another version are rebuilt.
CONVERTER_VERSION = 1

Log = Callable[[str], None]


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors as `mx.load` gives them, and metadata as plain Python values."""
    tensors, raw = mx.load(str(path), return_metadata=True)
    meta = {key: value.tolist() if isinstance(value, mx.array) else value for key, value in raw.items()}
    return tensors, meta


def llama_config(meta: dict[str, Any], has_lm_head: bool) -> dict[str, Any]:
    """config.json for a llama GGUF."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only llama GGUFs convert, not {arch!r}")
    n_heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    head_dim = meta.get("llama.attention.key_length", hidden // n_heads)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embeddings are not supported")
    if "llama.rope.scaling.type" in meta:
        raise ValueError("GGUF rope scaling is not supported")
    ids = special_token_ids(meta)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", n_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest(meta["llama.attention.layer_norm_rms_epsilon"]),
        # Top level on purpose: mlx-lm reads `rope_theta` here and ignores
        # transformers-5 `rope_parameters`, silently falling back to 10000.
        "rope_theta": _shortest(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": meta["llama.context_length"],
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_lm_head,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": "float32",
    }


def convert_gguf(gguf_path: Path, out_dir: Path, log: Log = print) -> None:
    """Write model.safetensors, config.json, generation_config.json and the tokenizer files into out_dir."""
    log(f"reading {gguf_path.name}")
    tensors, meta = read_gguf(gguf_path)
    config = llama_config(meta, has_lm_head="output.weight" in tensors)

    log(f"dequantizing {len({n.rsplit('.', 1)[0] for n in tensors})} tensors to float32")
    weights = hf_llama_weights(tensors, config["num_attention_heads"], config["num_key_value_heads"])
    mx.eval(weights)
    n_bytes = sum(w.nbytes for w in weights.values())
    log(f"writing model.safetensors ({n_bytes / 2**20:.0f} MiB)")
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "pt"})

    log("writing config and tokenizer")
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))


def _shortest(value: float) -> float:
    """A float32 GGUF value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
