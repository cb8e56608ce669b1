"""Mixture of experts as Qwen3.5-MoE and Qwen3-Next route it: a softmax router picks
the top-k experts per token (their weights renormalised when `norm_topk_prob`), and
one shared expert, scaled by its own sigmoid gate, sees every token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfork.backends.torch.config import HybridConfig


class GLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared expert."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Every expert's GLU in two stacked tensors (the transformers layout):
    gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; chosen, weights [T, k]. Each expert runs once, on the tokens routed to it."""
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            token, slot = (chosen == expert).nonzero(as_tuple=True)
            gate, up = (x[token] @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[expert].T
            out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.top_k, self.renormalise = cfg.experts_per_token, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = GLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        routed = self.experts(flat, chosen, weights)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(x.shape)
