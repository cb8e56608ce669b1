"""Decoder-only transformers: llama, qwen2, qwen3, gemma3 text, in one file; the text models of
Qwen2.5-VL and Gemma 3 too, which read images as embeddings in place of tokens (images.py).

Module names follow the Hugging Face checkpoints, so a safetensors file loads
with `load_state_dict` as it is.

The forward pass takes one varlen batch: the tokens of several rows laid end to
end, each row with its own KV state and start position (a decode row is one
token, a prefill chunk many; one pass may mix them). Everything but attention
runs over all tokens at once, so a step reads the weights once; attention reads
each row's own buffers at its own length (backends/torch/attention.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvfork.backends.torch.attention import attend_rows
from kvfork.backends.torch import images as image_tokens
from kvfork.backends.torch.config import ArchConfig
from kvfork.backends.torch.images import PlacedImage
from kvfork.backends.torch.kv import LayerKV
from kvfork.backends.torch.rope import angles, inverse_frequencies, rotate


class RMSNorm(nn.Module):
    """x / rms(x) * w; gemma stores w zero-centred and scales by (1 + w)."""

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (self.offset + self.weight.float())).to(x.dtype)


@dataclass(frozen=True)
class VarlenRow:
    """One row of a varlen batch: `length` tokens written to `kv` (one state per layer) from `start`."""

    kv: Sequence[LayerKV]
    start: int
    length: int


def spans(rows: Sequence[VarlenRow]) -> list[slice]:
    """Each row's tokens in the varlen batch."""
    ends = list(itertools.accumulate(row.length for row in rows))
    return [slice(end - row.length, end) for row, end in zip(rows, ends)]


def read_positions(rows: Sequence[VarlenRow], reads: Sequence[int] | None = None) -> list[int]:
    """The tokens of the varlen batch whose logits are read: each row's last, or its last `reads[i]`."""
    counts = reads if reads is not None else [1] * len(rows)
    return [i for span, n in zip(spans(rows), counts) for i in range(span.stop - n, span.stop)]


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, window: int | None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window, self.scale = window, cfg.attn_scale
        self.bidirectional_images = cfg.bidirectional_images
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            offset = 1.0 if cfg.gemma else 0.0
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, offset)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layer: int, rows: Sequence[VarlenRow],
                images: Sequence[Sequence[PlacedImage]] | None = None):
        """x: [tokens, hidden], the rows' tokens end to end; `images[i]`: row i's images."""
        t = x.shape[0]
        q = self.q_proj(x).view(1, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(1, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, t, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        # Head-major views [heads, tokens, head_dim], as the KV buffers hold them.
        q, k, v = (u[0].transpose(0, 1) for u in (rotate(q, *rope), rotate(k, *rope), v))
        out = attend_rows(q, k, v, [row.kv[layer] for row in rows], [row.start for row in rows], spans(rows),
                          self.window, self.scale, images if self.bidirectional_images else None)
        return self.o_proj(out.view(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gemma = cfg.gemma

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gemma else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block; gemma also norms each sublayer's output ("sandwich" norms)."""

    def __init__(self, cfg: ArchConfig, window: int | None):
        super().__init__()
        offset = 1.0 if cfg.gemma else 0.0
        self.self_attn = Attention(cfg, window)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, offset)
        self.gemma = cfg.gemma
        if cfg.gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, offset)

    def forward(self, x, rope, layer: int, rows: Sequence[VarlenRow],
                images: Sequence[Sequence[PlacedImage]] | None = None):
        attn = self.self_attn(self.input_layernorm(x), rope, layer, rows, images)
        if not self.gemma:
            h = x + attn
            return h + self.mlp(self.post_attention_layernorm(h))
        h = x + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, window) for window in cfg.sliding)
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, 1.0 if cfg.gemma else 0.0)


class Transformer(nn.Module):
    def __init__(self, cfg: ArchConfig, tied: bool):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = None if tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def place(self, device: torch.device) -> None:
        """Rope frequencies live outside the state dict: build them on the model's device."""
        inv_freq_full, self.rope_scale_full = inverse_frequencies(self.cfg.rope_full, self.cfg.head_dim)
        inv_freq_sliding, self.rope_scale_sliding = inverse_frequencies(self.cfg.rope_sliding, self.cfg.head_dim)
        self.inv_freq_full, self.inv_freq_sliding = inv_freq_full.to(device), inv_freq_sliding.to(device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: Sequence[VarlenRow],
                reads: Sequence[int] | None = None,
                images: Sequence[Sequence[PlacedImage]] | None = None) -> torch.Tensor:
        """tokens, positions: [tokens], the rows' end to end (M-RoPE: positions [3, tokens]). Returns each row's
        last-token logits, [rows, vocab]; with `reads`, the last reads[i] tokens' of row i, [sum(reads), vocab]
        (drafted tokens verified); `images[i]`: the images whose embeddings take row i's slots they hold."""
        # once per pass, shared by every layer of a kind
        if self.cfg.mrope_section:
            full = image_tokens.mrope_angles(positions, self.inv_freq_full, self.cfg.mrope_section,
                                             self.rope_scale_full)
        else:
            full = angles(positions[None], self.inv_freq_full, self.rope_scale_full)
        sliding = angles(positions[None], self.inv_freq_sliding, self.rope_scale_sliding) if any(self.cfg.sliding) \
            else full
        h = self.model.embed_tokens(tokens)
        if self.cfg.gemma:
            h = h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype)  # in the model dtype, as trained
        if images is not None and any(images):
            h = image_tokens.scatter(h, [row.start for row in rows], [row.length for row in rows], images)
        for i, block in enumerate(self.model.layers):
            h = block(h, sliding if self.cfg.sliding[i] else full, i, rows, images)
        h = self.model.norm(h[read_positions(rows, reads)])
        if self.lm_head is not None:
            return self.lm_head(h)
        return h @ self.model.embed_tokens.weight.T
