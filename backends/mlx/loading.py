"""Load a model through mlx-lm and describe it as a `ModelInfo`.

The description is read from what the model builds, not from config keys that
differ per architecture: the layer kinds come from the model's own cache list,
and the KV bytes per token from one token run through a fresh cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load

from backends.base import LayerAttention, ModelInfo
from backends.model_path import resolve_model

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def default_dtype() -> str:
    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def load_model(folder: str, dtype: str | None) -> tuple[nn.Module, Any, ModelInfo]:
    """(model, tokenizer, info). `folder` may also be a hub id (see backends.model_path)."""
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    path = resolve_model(str(folder))
    model, tokenizer, config = load(str(path), return_config=True)
    # Quantized weights stay packed: set_dtype casts floating parameters only.
    model.set_dtype(DTYPES[dtype])
    layers = layer_kinds(model)
    vocab_size, kv_bytes_per_token, recurrent_bytes = _probe(model)
    info = ModelInfo(
        name=Path(folder).name or str(folder),
        vocab_size=vocab_size,
        context_length=_context_length(config, path),
        layers=layers,
        eos_token_ids=_eos_ids(config, path, tokenizer),
        kv_bytes_per_token=kv_bytes_per_token,
        dtype=dtype,
        device="metal" if mx.default_device() == mx.gpu else "cpu",
        recurrent_bytes=recurrent_bytes,
    )
    return model, tokenizer, info



def layer_kinds(model: nn.Module) -> tuple[LayerAttention, ...]:
    # Design rule: plain and rotating KV caches can be cloned at any position they
    # hold, recurrent state (ArraysCache: Gated DeltaNet, Mamba, short convolutions)
    # at the session's position only (base.clone_positions); other state (chunked,
    # lists of caches) cannot, so such models are refused here with a clear message
    # instead of failing on the first clone.
    kinds = []
    for i, cache in enumerate(make_prompt_cache(model)):
        if type(cache) is KVCache:
            kinds.append(LayerAttention("full"))
        elif type(cache) is RotatingKVCache and cache.keep == 0:
            kinds.append(LayerAttention("sliding", cache.max_size))
        elif type(cache) is ArraysCache:
            kinds.append(LayerAttention("recurrent"))
        else:
            raise ValueError(f"layer {i} keeps {type(cache).__name__} state, which kvfork cannot clone")
    return tuple(kinds)


def _probe(model: nn.Module) -> tuple[int, int, int]:
    """(vocab size, KV bytes per token of the full layers, bytes of the recurrent layers'
    fixed-size state), from one token run."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    mx.eval(logits)
    full = [c for c in cache if type(c) is KVCache]
    recurrent = sum(c.nbytes for c in cache if type(c) is ArraysCache)
    return int(logits.shape[-1]), sum(c.keys[..., :1, :].nbytes + c.values[..., :1, :].nbytes for c in full), recurrent


def _context_length(config: dict, path: Path) -> int:
    for source in (config, config.get("text_config", {})):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            if isinstance(source.get(key), int):
                return source[key]
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    length = tokenizer_config.get("model_max_length")
    return length if isinstance(length, int) and length < 10**7 else 2048


def _eos_ids(config: dict, path: Path, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from config.json, generation_config.json and the tokenizer, first seen first."""
    found: list[int] = []

    def add(value: Any) -> None:
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and v not in found:
                found.append(v)

    add(config.get("eos_token_id"))
    add(config.get("text_config", {}).get("eos_token_id"))
    add(_read_json(path / "generation_config.json").get("eos_token_id"))
    add(getattr(tokenizer, "eos_token_id", None))
    add(sorted(getattr(tokenizer, "eos_token_ids", ()) or ()))
    return tuple(found)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}
