"""Rotary position embedding, "rotate half" (GPT-NeoX) layout as in every family here.

Positions come per row, so one decode batch can hold sessions at different lengths.
A scaled rope's frequencies and attention factor come from transformers (backends/rope_scaling.py).
"""

from __future__ import annotations

import torch

from kvfork.backends import rope_scaling
from kvfork.backends.torch.config import Rope


def inverse_frequencies(rope: Rope, head_dim: int) -> tuple[torch.Tensor, float]:
    """theta^(-2i/d) as the config's scaling reshapes it (float32), and the factor cos and sin are scaled by."""
    if rope_scaling.kind(rope.scaling) is None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        return (1.0 / rope.theta**exponents).to(torch.float32), 1.0
    return rope_scaling.frequencies(rope.scaling, rope.theta, head_dim, rope.max_positions)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (times the attention factor `scale`) for positions [batch, seq], shaped to broadcast over
    heads: [batch, seq, 1, head_dim/2]."""
    theta = positions.to(torch.float32)[:, :, None, None] * inv_freq
    if scale == 1.0:
        return theta.cos(), theta.sin()
    return theta.cos() * scale, theta.sin() * scale


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim], each half-pair turned by its angle (in float32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
