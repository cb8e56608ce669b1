"""Tensor parallelism of the torch model code over `torch.distributed` (gloo on the CPU, NCCL on GPUs).

The split (Megatron-LM's, Shoeybi et al. 2019), rank r of N:
- attention: q, k, v projections by heads (rows), the output projection by the same heads
  (columns). Each rank attends over its own heads, so its KV state holds kv_heads / N heads:
  every session, clone, checkpoint and saved state of a rank is its shard of the KV state;
- a hybrid's Gated DeltaNet layer (hybrid.py) the same way by its key and value heads: the
  [q; k; v] projection and its convolution segment by segment, z, b, a, the decay rates and the
  output projection by value heads, so each rank's recurrent state holds its heads;
- MLP: gate and up projections by intermediate columns (rows), the down projection by the same
  columns; routed experts each by their own columns (the router stays whole: every rank routes a
  token alike), the shared expert like a dense MLP;
- each of those sublayers then yields a partial sum of its output: one all_reduce per sublayer
  (`Reduced`), two per layer, before the residual add (and gemma's post-norms) reads it;
- the vocabulary by rows, padded to a multiple of N: the embedding looks up the rows it holds
  and all_reduces (`VocabEmbedding`); the head computes the logits of its rows and all_gathers
  them (`VocabHead`), so every rank returns the whole row of logits and rank 0 samples from it;
- norms (and a bias after a column split) stay whole: a bias is added by rank 0 alone, so the
  sum carries it once.

Weights are read split (`local_weight` on safetensors' slices), so a rank never holds more than its
shard; a hybrid's checkpoint, whose layouts are brought to the model's names first (checkpoints.py),
is read whole and split then. What cannot split is refused at load with the reason (`refusal`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kvfork.backends.torch.config import ArchConfig, HybridConfig


@dataclass(frozen=True)
class Shards:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group

    def rows(self, total: int) -> tuple[int, int]:
        """[lo, hi) of `total` rows split evenly (the caller has checked that N divides it)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab_rows(self, vocab: int) -> tuple[int, int]:
        """[lo, hi) of the vocabulary padded to a multiple of N: hi - lo is the same on every rank."""
        per = -(-vocab // self.size)
        return self.rank * per, (self.rank + 1) * per


def refusal(cfg: ArchConfig | HybridConfig, size: int) -> str | None:
    """Why a model cannot be split over `size` ranks, or None when it can."""
    counts = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads,
              "MLP columns (intermediate_size)": cfg.intermediate_size}
    if isinstance(cfg, HybridConfig):
        counts.update({"DeltaNet key heads": cfg.linear_k_heads, "DeltaNet value heads": cfg.linear_v_heads,
                       "expert MLP columns": cfg.moe_intermediate_size,
                       "shared expert MLP columns": cfg.shared_expert_intermediate_size})
    odd = [f"{n} {what}" for what, n in counts.items() if n % size]
    if odd:
        return (f"tensor parallelism over {size} ranks splits heads and MLP columns evenly, and this model has "
                f"{', '.join(odd)}: not a multiple of {size}")
    return None


def local_config(cfg: ArchConfig | HybridConfig, size: int) -> ArchConfig | HybridConfig:
    """The shapes one rank's modules have (the vocabulary stays whole: VocabEmbedding and VocabHead hold its rows)."""
    split = dict(num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                 intermediate_size=cfg.intermediate_size // size)
    if isinstance(cfg, HybridConfig):
        split.update(linear_k_heads=cfg.linear_k_heads // size, linear_v_heads=cfg.linear_v_heads // size,
                     moe_intermediate_size=cfg.moe_intermediate_size // size,
                     shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size)
    return dataclasses.replace(cfg, **split)


# How each weight splits, by the end of its name (the first that matches): (axis, segments), each segment
# of the axis split evenly over the ranks (rank r keeps part r of every segment, in order; None: the
# axis is one segment); "rank 0" for a bias added after the sum; "vocabulary" rows. Rows of a
# [out, in] weight are axis 0, columns axis 1. Anything not listed is held whole (norms, routers).
def _qkv(cfg: HybridConfig) -> list[int]:  # a DeltaNet layer's [q; k; v] projection and convolution
    key = cfg.linear_k_heads * cfg.linear_k_dim
    return [key, key, cfg.linear_v_heads * cfg.linear_v_dim]


_SPLITS: tuple[tuple[tuple[str, ...], Any], ...] = (
    (("embed_tokens.weight", "lm_head.weight"), "vocabulary"),
    (("o_proj.bias", "down_proj.bias"), "rank 0"),
    (("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
      "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "in_proj_z.weight",
      "in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"), (0, None)),
    (("o_proj.weight", "down_proj.weight", "out_proj.weight"), (1, None)),
    (("in_proj_qkv.weight", "conv1d.weight"), lambda cfg: (0, _qkv(cfg))),
    (("experts.gate_up_proj",), lambda cfg: (1, [cfg.moe_intermediate_size] * 2)),
    (("experts.down_proj",), (2, None)),
)


def _split_of(name: str, cfg: ArchConfig | HybridConfig) -> Any:
    how = next((how for suffixes, how in _SPLITS if name.endswith(suffixes)), None)
    return how(cfg) if callable(how) else how


def local_weight(name: str, source: Any, shape: Sequence[int], cfg: ArchConfig | HybridConfig,
                 shards: Shards) -> torch.Tensor:
    """This rank's part of weight `name` (whole `shape`, named as the model's state dict), read from
    `source` (a tensor or a safetensors slice: only the parts indexed are read)."""
    how = _split_of(name, cfg)
    if how is None:
        return source[:]
    if how == "rank 0":
        return source[:] if shards.rank == 0 else torch.zeros(tuple(shape), dtype=source[:1].dtype)
    if how == "vocabulary":
        lo, hi = shards.vocab_rows(shape[0])
        part = source[lo:min(hi, shape[0])]
        return F.pad(part, (0, 0, 0, hi - lo - part.shape[0])) if part.shape[0] < hi - lo else part
    axis, segments = how
    parts, at = [], 0
    for length in segments or [shape[axis]]:
        lo, hi = shards.rows(length)
        parts.append(source[(slice(None),) * axis + (slice(at + lo, at + hi),)])
        at += length
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)


def split_vocabulary(model: nn.Module, cfg: ArchConfig | HybridConfig, shards: Shards) -> None:
    """Before the weights load: the embedding (and an untied head) sized to this rank's vocabulary rows."""
    lo, hi = shards.vocab_rows(cfg.vocab_size)
    model.model.embed_tokens = VocabEmbedding(hi - lo, cfg.hidden_size, lo, shards.group)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(cfg.hidden_size, hi - lo, bias=False)


def join_sublayers(model: nn.Module, cfg: ArchConfig | HybridConfig, shards: Shards) -> None:
    """Once the weights are in: each attention and MLP sums its ranks' partial outputs, and the head
    gathers every rank's logits (a tied head reads the embedding's rows)."""
    for block in model.model.layers:
        mixer = "linear_attn" if getattr(block, "linear", False) else "self_attn"  # a hybrid's DeltaNet layer
        setattr(block, mixer, Reduced(getattr(block, mixer), shards.group))
        block.mlp = Reduced(block.mlp, shards.group)
    head = model.lm_head
    if head is None:
        head = nn.Linear(cfg.hidden_size, model.model.embed_tokens.num_embeddings, bias=False)
        head.weight = model.model.embed_tokens.weight
    model.lm_head = VocabHead(head, cfg.vocab_size, shards)


class Reduced(nn.Module):
    """A sublayer whose ranks each compute a partial sum of its output: the sum, on every rank."""

    def __init__(self, inner: nn.Module, group: Any):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.inner(*args)
        dist.all_reduce(out, group=self.group)
        return out


class VocabEmbedding(nn.Embedding):
    """The embedding rows [lo, lo + rows) of the vocabulary: each rank looks up the tokens it holds,
    zeros for the others, and the all_reduce gives every token its row."""

    def __init__(self, rows: int, dim: int, lo: int, group: Any):
        super().__init__(rows, dim)
        self.lo, self.group = lo, group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.lo
        held = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight) * held[:, None].to(self.weight.dtype)
        dist.all_reduce(out, group=self.group)
        return out


class VocabHead(nn.Module):
    """The logits of this rank's vocabulary rows, gathered from every rank: [rows, vocab] on each."""

    def __init__(self, linear: nn.Module, vocab: int, shards: Shards):
        super().__init__()
        self.linear, self.vocab, self.shards = linear, vocab, shards

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = self.linear(h).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.shards.size)]
        dist.all_gather(parts, local, group=self.shards.group)
        return torch.cat(parts, dim=-1)[..., :self.vocab]
