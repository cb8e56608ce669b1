"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers with a gated
full-attention layer every few, in one file.

Module names follow the Qwen3.5 Hugging Face checkpoints with their
`model.language_model.` prefix shortened to `model.` (checkpoints.py brings every
layout to these). Norms are zero-centred, x * (1 + w), except the gated norm
inside the DeltaNet layer.

Same calling convention as model.Transformer: rows of tokens, each row with its
own per-layer state (GrowingKV for attention layers, RecurrentState for the
DeltaNet ones) and start position.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from backends.torch.config import HybridConfig
from backends.torch.gated_delta import GatedDeltaNet, RecurrentState
from backends.torch.kv import GROW_STEP, GrowingKV
from backends.torch.model import RMSNorm
from backends.torch.moe import GLU, SparseMoE
from backends.torch.rope import angles, inverse_frequencies, rotate

HybridLayerState = GrowingKV | RecurrentState


def new_states(cfg: HybridConfig, dtype, device) -> list[HybridLayerState]:
    """A fresh session's per-layer state."""
    return [
        RecurrentState.empty(cfg, dtype, device) if linear
        else GrowingKV.empty(cfg.num_kv_heads, cfg.head_dim, GROW_STEP, dtype, device)
        for linear in cfg.linear
    ]


def recurrent_bytes(cfg: HybridConfig, dtype: torch.dtype) -> int:
    """Bytes of one session's recurrent state (all DeltaNet layers), whatever its length."""
    conv_dim = 2 * cfg.linear_k_heads * cfg.linear_k_dim + cfg.linear_v_heads * cfg.linear_v_dim
    conv = (cfg.conv_kernel - 1) * conv_dim * dtype.itemsize
    delta_rule = cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4  # float32
    per_layer = conv + delta_rule
    return per_layer * sum(cfg.linear)


class GatedAttention(nn.Module):
    """Full attention with q/k norms, rotary on the first `rotary_dim` of each head, and an
    output gate: q_proj yields, per head, the query then a gate; out = o_proj(attn * sigmoid(gate))."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        self.q_proj = nn.Linear(cfg.hidden_size, 2 * self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps, 1.0)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps, 1.0)

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        turned, kept = x.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat((rotate(turned, *rope), kept), dim=-1)

    def forward(self, x: torch.Tensor, rope, kv: Sequence[GrowingKV], starts: Sequence[int]) -> torch.Tensor:
        b, n, _ = x.shape
        q, gate = self.q_proj(x).view(b, n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        q, k = self._rotate(self.q_norm(q), rope), self._rotate(self.k_norm(k), rope)
        out = torch.cat([self._attend(q[i : i + 1], k[i], v[i], kv[i], starts[i]) for i in range(b)])
        return self.o_proj(out.reshape(b, n, -1) * torch.sigmoid(gate.reshape(b, n, -1)))

    def _attend(self, q, k, v, kv: GrowingKV, start: int) -> torch.Tensor:
        keys, values, _ = kv.update(k, v, start)
        mask = None if q.shape[1] == 1 else causal_lower_right(q.shape[1], keys.shape[0])
        heads_first = [t.transpose(-3, -2) for t in (q, keys[None], values[None])]
        return F.scaled_dot_product_attention(*heads_first, attn_mask=mask, enable_gqa=True).transpose(1, 2)


class HybridBlock(nn.Module):
    def __init__(self, cfg: HybridConfig, linear: bool, moe: bool):
        super().__init__()
        self.linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoE(cfg) if moe else GLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, 1.0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, 1.0)

    def forward(self, x, rope, states: Sequence[HybridLayerState], starts: Sequence[int]):
        normed = self.input_layernorm(x)
        mixed = self.linear_attn(normed, states) if self.linear else self.self_attn(normed, rope, states, starts)
        h = x + mixed
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridDecoder(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridBlock(cfg, linear, moe) for linear, moe in zip(cfg.linear, cfg.moe))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, 1.0)


class HybridTransformer(nn.Module):
    def __init__(self, cfg: HybridConfig, tied: bool):
        super().__init__()
        self.cfg = cfg
        self.model = HybridDecoder(cfg)
        self.lm_head = None if tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def place(self, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(self.cfg.rope, self.cfg.rotary_dim).to(device)

    def set_chunked_prefill(self, chunked: bool) -> None:
        """Chunked (the default) or token-by-token delta rule in prefill; the tools compare both."""
        for block in self.model.layers:
            if block.linear:
                block.linear_attn.chunked_prefill = chunked

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, states: Sequence[Sequence[HybridLayerState]],
                starts: Sequence[int]) -> torch.Tensor:
        """tokens, positions: [rows, n]; states[row][layer]. Returns the last position's logits, [rows, vocab]."""
        rope = angles(positions, self.inv_freq)
        h = self.model.embed_tokens(tokens)
        for i, block in enumerate(self.model.layers):
            h = block(h, rope, [row[i] for row in states], starts)
        h = self.model.norm(h[:, -1])
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        return h @ head.T
