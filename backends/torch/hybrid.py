"""Qwen3.5 (dense and MoE) and Qwen3-Next: Gated DeltaNet layers with a gated
full-attention layer every few, in one file.

Module names follow the Qwen3.5 Hugging Face checkpoints with their
`model.language_model.` prefix shortened to `model.` (checkpoints.py brings every
layout to these). Norms are zero-centred, x * (1 + w), except the gated norm
inside the DeltaNet layer.

Same calling convention as model.Transformer: one varlen batch of rows
(model.VarlenRow), each row with its own per-layer state (kv.FullKV for attention
layers, RecurrentState for the DeltaNet ones) and start position, decode rows
and prefill chunks mixed in one pass. Projections, MLPs and experts run over all
tokens at once; attention and the DeltaNet recurrence run row by row, over each
session's own state.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import torch
from torch import nn

from kvfork.backends.torch import kv
from kvfork.backends.torch.attention import attend_rows
from kvfork.backends.torch.config import HybridConfig
from kvfork.backends.torch.gated_delta import GatedDeltaNet, RecurrentState
from kvfork.backends.torch.kv import BlockTable, FullKV
from kvfork.backends.torch.model import RMSNorm, VarlenRow, read_positions, spans
from kvfork.backends.torch.moe import GLU, SparseMoE
from kvfork.backends.torch.rope import angles, inverse_frequencies, rotate

HybridLayerState = FullKV | RecurrentState


def new_states(cfg: HybridConfig, table: BlockTable, dtype, device) -> list[HybridLayerState]:
    """A fresh session's per-layer state: its block table's layer for each attention layer."""
    full = itertools.count()
    return [RecurrentState.empty(cfg, dtype, device) if linear else FullKV(table, next(full)) for linear in cfg.linear]


def in_place_writes(states: Sequence[kv.LayerKV | RecurrentState]) -> int:
    """Writes to state a failed pass cannot take back (rings, recurrent states): a session whose
    count moved during a failed call is CORRUPT (base.RowState)."""
    return kv.ring_writes(states) + sum(s.writes for s in states if isinstance(s, RecurrentState))


def recurrent_copies(states: Sequence[kv.LayerKV | RecurrentState]) -> list[RecurrentState]:
    """Copies of a session's recurrent layers' states (a checkpoint), in layer order."""
    return [s.copy_prefix(0) for s in states if isinstance(s, RecurrentState)]


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

    def forward(self, x: torch.Tensor, rope, layer: int, rows: Sequence[VarlenRow]) -> torch.Tensor:
        """x: [tokens, hidden], the rows' tokens end to end."""
        t = x.shape[0]
        q, gate = self.q_proj(x).view(1, t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(1, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(1, t, self.kv_heads, self.head_dim)
        q, k = self._rotate(self.q_norm(q), rope), self._rotate(self.k_norm(k), rope)
        # Head-major views [heads, tokens, head_dim], as the KV buffers hold them.
        q, k, v = (u[0].transpose(0, 1) for u in (q, k, v))
        out = attend_rows(q, k, v, [row.kv[layer] for row in rows], [row.start for row in rows], spans(rows),
                          None, self.head_dim**-0.5)
        return self.o_proj(out.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


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

    def forward(self, x, rope, layer: int, rows: Sequence[VarlenRow]):
        normed = self.input_layernorm(x)
        mixed = self._recurrence(normed, layer, rows) if self.linear else self.self_attn(normed, rope, layer, rows)
        h = x + mixed
        return h + self.mlp(self.post_attention_layernorm(h))

    def _recurrence(self, x: torch.Tensor, layer: int, rows: Sequence[VarlenRow]) -> torch.Tensor:
        """The DeltaNet layer over each row's own state: all one-token (decode) rows as one batch,
        each longer chunk alone (rows of different lengths do not stack)."""
        out = torch.empty_like(x)
        decoding = [span.start for row, span in zip(rows, spans(rows)) if row.length == 1]
        if decoding:
            states = [row.kv[layer] for row in rows if row.length == 1]
            out[decoding] = self.linear_attn(x[decoding][:, None], states)[:, 0]
        for row, span in zip(rows, spans(rows)):
            if row.length > 1:
                out[span] = self.linear_attn(x[span][None], [row.kv[layer]])[0]
        return out


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
        inv_freq, self.rope_scale = inverse_frequencies(self.cfg.rope, self.cfg.rotary_dim)
        self.inv_freq = inv_freq.to(device)

    def set_chunked_prefill(self, chunked: bool) -> None:
        """Chunked (the default) or token-by-token delta rule in prefill; the tools compare both."""
        for block in self.model.layers:
            if block.linear:
                block.linear_attn.chunked_prefill = chunked

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, rows: Sequence[VarlenRow]) -> torch.Tensor:
        """tokens, positions: [tokens], the rows' end to end; row.kv[layer] is a HybridLayerState.
        Returns each row's last-token logits, [rows, vocab]."""
        rope = angles(positions[None], self.inv_freq, self.rope_scale)
        h = self.model.embed_tokens(tokens)
        for i, block in enumerate(self.model.layers):
            h = block(h, rope, i, rows)
        h = self.model.norm(h[read_positions(rows)])
        if self.lm_head is not None:
            return self.lm_head(h)
        return h @ self.model.embed_tokens.weight.T
