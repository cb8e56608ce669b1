"""Load a model through mlx-lm and describe it as a `ModelInfo`.

The description is read from what the model builds, not from config keys that
differ per architecture: the layer kinds come from the model's own cache list,
and the KV bytes per token from one token run through a fresh cache. EOS ids and
the context length come from backends.model_info, the reader torch shares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.utils import load, load_model as lazy_model, sharded_load

from kvfork.backends.base import (BackendRefused, KV_CACHE_DTYPES, KVCost, KVStorage, KVStorageRefused,
                                  LayerAttention, ModelInfo)
from kvfork.backends.mlx import cpu_attention, kv_storage, ordered, vision
from kvfork.backends.mlx.kvcopy import STEP
from kvfork.backends.mlx.recurrent import state_bytes
from kvfork.backends.mlx.vision import MLXVisionReader
from kvfork.backends.model_info import read_model_facts
from kvfork.backends.model_path import resolve_model
from kvfork.backends.vision import folder_family

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def default_dtype() -> str:
    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def load_model(folder: str, dtype: str | None, group: Any = None, spec: KVStorage = KVStorage(),
               encoder_cache_bytes: int = 0, invariant: bool = False
               ) -> tuple[nn.Module, Any, ModelInfo, kv_storage.Storage | None, MLXVisionReader | None]:
    """(model, tokenizer, info, how KV is stored: `spec`, --kv-cache-dtype, the tower of a model that reads images:
    vision.py, its encoder cache of `encoder_cache_bytes`). `folder` may also be a hub id
    (see backends.model_path). `group`: an `mx.distributed` group of more than one rank splits the model over
    them, by mlx-lm's own tensor-parallel sharding (`Model.shard`, through `sharded_load`); each rank then
    holds its share of the weights and of every KV state, and `info.kv` prices a rank's share. `invariant`:
    --batch-invariant (ordered.py). KVStorageRefused where the model's heads cannot be stored as `spec` says, or
    the model or this CPU cannot be computed batch-invariantly."""
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    path = resolve_model(str(folder))
    family = folder_family(path)
    if family is not None:
        reason = vision.refusal(path, family)
        if reason is None and group is not None and group.size() > 1:
            reason = f"{path.name} reads images: a model that reads images is served on one rank"
        if reason is not None:
            raise BackendRefused(reason)
        model, tokenizer = vision.load_text_model(path)
    elif group is not None and group.size() > 1:
        reason = split_refusal(path, group.size())
        if reason is not None:
            raise ValueError(f"mlx backend: cannot split the model over {group.size()} ranks: {reason}")
        model, tokenizer = sharded_load(str(path), tensor_group=group)
    else:
        model, tokenizer = load(str(path))
    # Quantized weights stay packed: set_dtype casts floating parameters only.
    model.set_dtype(DTYPES[dtype])
    layers = layer_kinds(model)
    vocab_size, heads = _probe(model)
    compute = DTYPES[dtype]
    storage = kv_storage.storage_for(spec, compute, heads[1:], attended=True, ordered=invariant) if heads else None
    if invariant:
        ordered.order(model, layers, storage, family is not None, group.size() if group else 1)
    if isinstance(storage, kv_storage.QuantizedRows):
        kv_storage.refuse_sinks(model, spec)
        cpu_attention.install()
    if storage is not None and spec.rotates_keys:
        kv_storage.rotate_keys(model, sum(layer.kind != "recurrent" for layer in layers), spec)
    facts = read_model_facts(path)
    reader = None if family is None else MLXVisionReader(path, model, encoder_cache_bytes)
    info = ModelInfo(
        name=Path(folder).name or str(folder),
        vocab_size=vocab_size,
        context_length=facts.context_length,
        layers=layers,
        eos_token_ids=facts.eos_token_ids,
        kv=kv_cost(layers, token_bytes(storage, compute, heads), state_bytes(model)),
        dtype=dtype,
        device="metal" if mx.default_device() == mx.gpu else "cpu",
        kv_dtype=spec.label(dtype),
        kv_token_bytes=storages_bytes(layers, compute, heads, spec.group),
        reads_images=reader is not None,
        image_token_bytes=reader.token_bytes if reader is not None else 0,
    )
    return model, tokenizer, info, storage, reader


def split_refusal(path: Path, size: int) -> str | None:
    """Why mlx-lm cannot split the model in `path` over `size` ranks, or None when it can: its model
    class has no `shard` (today qwen3_next, lfm2, nemotron_h, granitemoehybrid, gemma3_text, olmo2 and
    more), or the head counts do not divide (mlx-lm's `shard` divides them without checking)."""
    config = json.loads((path / "config.json").read_text())
    family = config.get("model_type")
    if not hasattr(lazy_model(path, lazy=True, strict=False)[0], "shard"):
        return f"mlx-lm has no tensor-parallel sharding (Model.shard) for model_type {family!r}; serve it on one rank"
    text = config.get("text_config", config)
    heads = {"attention heads": text.get("num_attention_heads"), "KV heads": text.get("num_key_value_heads")}
    odd = [f"{n} {what}" for what, n in heads.items() if n and n % size]
    if odd:
        return (f"tensor parallelism over {size} ranks splits attention heads evenly, and this model has "
                f"{', '.join(odd)}: not a multiple of {size}")
    return None


def layer_kinds(model: nn.Module) -> tuple[LayerAttention, ...]:
    """One kind per entry of the model's cache list (a hybrid's MLP-only layers keep none).

    Design rule: kvfork clones plain and rotating KV caches, and recurrent state
    (`ArraysCache`: conv + SSM / delta-rule state) by the recurrent rule, base.clone_positions;
    other state (chunked attention, nested cache lists) is refused here with a
    clear message instead of failing on the first clone."""
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


def kv_cost(layers: tuple[LayerAttention, ...], per_token: int, state: int) -> KVCost:
    """Approximate, unlike torch's: mlx-lm's KVCache grows by whole steps of each write (a prefill
    chunk of n adds round_up(n) positions after the last used one, so chunked prefill may hold up to a
    step more per chunk), a ring grows towards its window in steps (and holds a chunk past it while
    prefilling), and the decode batch pads rows on the left to a common length. A clone holds
    round_up(upto) + STEP positions (kvcopy.with_room). So a session's count may stray by
    `tolerance` of its figure, plus one step of positions; the budget holds the padding of the rows
    (`padded_rows`: every request in an inference slot is held at least `row_bytes` of the longest)."""
    full = sum(1 for layer in layers if layer.kind == "full")
    rings = sum(layer.window or 0 for layer in layers if layer.kind == "sliding")
    return KVCost(full_bytes_per_token=per_token * full, ring_bytes=per_token * rings, step=STEP, slack=STEP, state_bytes=state,
                  tolerance=0.25, padded_rows=True)


def token_bytes(storage: kv_storage.Storage | None, compute: mx.Dtype, heads: tuple[int, int, int] | None) -> int:
    """KV bytes of one token in one attention layer as `storage` keeps it (scales and biases included)."""
    if heads is None:
        return 0
    kv_heads, key_dim, value_dim = heads
    return kv_heads * sum(kv_storage.row_bytes(storage, compute, dim) for dim in (key_dim, value_dim))


def storages_bytes(layers: tuple[LayerAttention, ...], compute: mx.Dtype, heads: tuple[int, int, int] | None,
                   group: int) -> tuple[tuple[str, int], ...]:
    """(storage, bytes per token of the full-attention layers) for the weights' dtype and each --kv-cache-dtype
    MLX takes for these heads with groups of `group` (ModelInfo.kv_token_bytes)."""
    full, out = sum(layer.kind == "full" for layer in layers), {}
    weights = next(name for name, d in DTYPES.items() if d == compute)
    for spec in (KVStorage(), *(KVStorage(name, group) for name in KV_CACHE_DTYPES[1:])):
        try:
            storage = kv_storage.storage_for(spec, compute, heads[1:]) if heads else None
        except KVStorageRefused:
            continue
        out[spec.label(weights)] = full * token_bytes(storage, compute, heads)
    return tuple(out.items())


def _probe(model: nn.Module) -> tuple[int, tuple[int, int, int] | None]:
    """(vocab size, (KV heads, key size, value size) of an attention layer), from one token run."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([[0]]), cache=cache)
    mx.eval(logits)
    # every attention layer's keys and values have one shape per token; an all-recurrent model has none
    attention = [c for c in cache if type(c) is KVCache] + [c for c in cache if type(c) is RotatingKVCache]
    if not attention:
        return int(logits.shape[-1]), None
    one = attention[0]
    return int(logits.shape[-1]), (one.keys.shape[1], one.keys.shape[-1], one.values.shape[-1])
