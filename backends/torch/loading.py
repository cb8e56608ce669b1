"""A model into our model code, and its description as a `ModelInfo` (what backends/mlx/loading.py
does through mlx-lm).

The weights come as Hugging Face names: read from a folder's safetensors (`read_weights`; a
tensor-parallel rank reads only its parts of them), a hybrid's checkpoint layouts brought to the
model's names (checkpoints.py), split over the ranks where they were read whole (parallel.py). The
model is built on the meta device and the weights assigned to it, so none is allocated twice. The
description's KV cost is exact for kv.py's layout, so the budget prices what a session allocates.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from kvfork.backends.base import KV_CACHE_DTYPES, KVCost, KVStorage, KVStorageRefused, LayerAttention, ModelInfo
from kvfork.backends.model_info import ModelFacts
from kvfork.backends.torch import checkpoints, hybrid, kv, kv_storage, ordered_attention, packed_linear, parallel
from kvfork.backends.torch.config import ArchConfig, HybridConfig, read_config
from kvfork.backends.torch.hybrid import HybridTransformer
from kvfork.backends.torch.model import Transformer


@dataclass(frozen=True)
class Built:
    """A model built from a folder (its weights read, converted and packed), for another backend of the process
    to serve (TorchBackend.reuse): nothing in it changes after `build`."""

    source: tuple[str, str | None, str]  # (folder, the dtype a load asked for, device)
    model_dtype: torch.dtype
    model: Transformer | HybridTransformer
    cfg: ArchConfig | HybridConfig


def read(folder: Path, device: torch.device,
         shards: parallel.Shards | None) -> tuple[ArchConfig | HybridConfig, dict[str, torch.Tensor], bool]:
    """A model folder's config and weights, and whether those are already this rank's parts (`build`'s
    `split`); with `shards`, a model that cannot split is refused before a weight is read."""
    cfg, part = read_config(folder), None
    if shards is not None:
        refuse_split(cfg, shards)
        # A rank reads its parts alone where checkpoint names are the model's; a hybrid's checkpoint
        # layouts (checkpoints.py) are brought to them first, so it reads the whole and splits it.
        if isinstance(cfg, ArchConfig):
            part = functools.partial(parallel.local_weight, cfg=cfg, shards=shards)
    return cfg, read_weights(folder, device, part), part is not None


def read_weights(folder: Path, device: torch.device,
                 part: Callable[[str, Any, list[int]], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Every weight of the folder by name; `part(name, slice, shape)`: the part of each one this rank
    holds (tensor parallelism), read from its safetensors slice so the rest is never read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    weights = {}
    for path in files:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                key = text_name(name)
                if part is None:
                    weights[key] = f.get_tensor(name)
                else:
                    piece = f.get_slice(name)
                    weights[key] = part(key, piece, piece.get_shape())
    return weights


def text_name(name: str) -> str:
    """A weight's name in our text model: a vision-language checkpoint nests its text model under
    `language_model` (transformers 5: `model.language_model.`; older ones: `language_model.model.`)."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name.removeprefix("language_model.")


def refuse_split(cfg: ArchConfig | HybridConfig, shards: parallel.Shards) -> None:
    """Raise, with the reason, where the model cannot split over the group's ranks."""
    reason = parallel.refusal(cfg, shards.size)
    if reason is not None:
        raise ValueError(f"torch backend: cannot split the model over {shards.size} ranks: {reason}")


def build(cfg: ArchConfig | HybridConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
          shards: parallel.Shards | None, split: bool) -> tuple[Transformer | HybridTransformer,
                                                                 ArchConfig | HybridConfig]:
    """The model on `device`, in eval mode, and its config: with `shards`, this rank's part of both
    (`split`: the weights are already this rank's parts, parallel.local_weight)."""
    if isinstance(cfg, HybridConfig):
        weights = checkpoints.canonical(cfg, weights)
    if shards is not None:
        refuse_split(cfg, shards)
        if not split:
            weights = {k: parallel.local_weight(k, w, w.shape, cfg, shards) for k, w in weights.items()}
        cfg = parallel.local_config(cfg, shards.size)
    with torch.device("meta"):
        tied = "lm_head.weight" not in weights
        model = HybridTransformer(cfg, tied) if isinstance(cfg, HybridConfig) else Transformer(cfg, tied)
        if shards is not None:
            parallel.split_vocabulary(model, cfg, shards)
    wanted = model.state_dict().keys()
    # A DeltaNet layer's decay rates stay float32 (as mlx-lm keeps them): exp(A_log) in bf16 is off by ~1%.
    dtypes = {k: torch.float32 if k.endswith("A_log") else dtype for k in wanted}
    model.load_state_dict({k: weights[k].to(device, dtypes[k]) for k in wanted if k in weights},
                          strict=True, assign=True)
    model.place(device)
    if shards is not None:
        parallel.join_sublayers(model, cfg, shards)
        tied = False  # the head is installed: its own rows, or the embedding's
    if packed_linear.available(device, dtype):
        packed_linear.pack(model, model.model.embed_tokens.weight if tied else None)
    return model.eval(), cfg


def set_batch_invariant(model: Transformer | HybridTransformer, cfg: ArchConfig | HybridConfig, on: bool) -> None:
    """Let `model`'s linear layers compute batch-invariantly (`on`: at two rows or more, packed_linear.PackedLinear)
    or as fast as they can; its storage's `invariant` does the same for attention. KVStorageRefused where the
    model or the CPU cannot: the order is shown for oneDNN's float32 linear layers on the CPU and for full causal
    attention alone, and the kernels' orders it rests on are tried on this CPU."""
    if on:
        linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, packed_linear.PackedLinear))]
        reason = ("recurrent layers (their chunked prefill and step-wise decode add in other orders)"
                  if isinstance(cfg, HybridConfig) else
                  "sliding-window layers (a ring's slots are not in position order)" if any(cfg.sliding) else
                  "linear layers other than oneDNN's (float32 weights on the CPU)"
                  if not all(isinstance(m, packed_linear.PackedLinear) for m in linears) else None)
        if reason is not None:
            raise KVStorageRefused(f"--batch-invariant: not for {reason}")
        unordered = packed_linear.unordered_rows(linears) or ordered_attention.unordered_products(cfg.head_dim)
        if unordered is not None:
            raise KVStorageRefused(f"--batch-invariant: {unordered}")
    for module in model.modules():
        if isinstance(module, packed_linear.PackedLinear):
            module.least_rows = 2 if on else 1


def weight_bytes(model: Transformer | HybridTransformer, *more: torch.nn.Module) -> int:
    """What the model's weights occupy on its device, its packed projections included; with `more`
    (a vision tower), theirs too."""
    return sum(sum(t.nbytes for t in itertools.chain(m.parameters(), m.buffers())) + sum(
        p.nbytes for p in m.modules() if isinstance(p, packed_linear.PackedLinear)) for m in (model, *more))


def full_layers(cfg: ArchConfig | HybridConfig) -> int:
    """How many layers attend over every position (the layers of a session's block table)."""
    if isinstance(cfg, HybridConfig):
        return sum(not linear for linear in cfg.linear)
    return sum(not w for w in cfg.sliding)


def describe(cfg: ArchConfig | HybridConfig, name: str, facts: ModelFacts, dtype: torch.dtype, device: torch.device,
             shares: bool, storage: kv_storage.Storage, spec: KVStorage) -> ModelInfo:
    """`shares`: a clone reads the whole blocks below it by reference (kv.py's `share` clone mode);
    `storage`: how keys and values are stored (`spec`, --kv-cache-dtype)."""
    if isinstance(cfg, HybridConfig):
        layers = tuple(LayerAttention("recurrent") if linear else LayerAttention("full") for linear in cfg.linear)
        state = hybrid.recurrent_bytes(cfg, dtype)
    else:
        layers = tuple(LayerAttention("sliding", w) if w else LayerAttention("full") for w in cfg.sliding)
        state = 0
    per_token = 2 * cfg.num_kv_heads * kv_storage.row_bytes(storage, cfg.head_dim)  # a token's keys, values; a layer
    # Exact: a full layer holds kv.capacity(n) = whole BLOCK_TOKENS blocks with one position always free
    # (opened, cloned or grown alike), less the whole blocks a clone reads by reference; one ring of
    # the window per sliding layer, and one recurrent state per session.
    cost = KVCost(full_bytes_per_token=per_token * sum(1 for layer in layers if layer.kind == "full"),
                  ring_bytes=per_token * sum(layer.window or 0 for layer in layers if layer.kind == "sliding"),
                  step=kv.BLOCK_TOKENS, spare=1, state_bytes=state, shares=shares)
    return ModelInfo(
        name=name,
        vocab_size=cfg.vocab_size,
        context_length=facts.context_length,
        layers=layers,
        eos_token_ids=facts.eos_token_ids,
        kv=cost,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        kv_dtype=spec.label(str(dtype).removeprefix("torch.")),
        kv_token_bytes=token_bytes(cfg, dtype, spec.group),
    )


def token_bytes(cfg: ArchConfig | HybridConfig, dtype: torch.dtype, group: int) -> tuple[tuple[str, int], ...]:
    """(storage, bytes per token of the full-attention layers) for the weights' dtype and each
    --kv-cache-dtype the head size takes with groups of `group` (ModelInfo.kv_token_bytes)."""
    out = {}
    for spec in (KVStorage(), *(KVStorage(name, group) for name in KV_CACHE_DTYPES[1:])):
        try:
            storage = kv_storage.storage_for(spec, dtype, cfg.head_dim)
        except KVStorageRefused:
            continue
        row = kv_storage.row_bytes(storage, cfg.head_dim)
        out[spec.label(str(dtype).removeprefix("torch."))] = 2 * cfg.num_kv_heads * row * full_layers(cfg)
    return tuple(out.items())
