"""Rotary position embedding, "rotate half" (GPT-NeoX) layout as in every family here.

Positions come per row, so one decode batch can hold sessions at different lengths.
"""

from __future__ import annotations

import math

import torch

from kvfork.backends.torch.config import Rope


def inverse_frequencies(rope: Rope, head_dim: int) -> torch.Tensor:
    """theta^(-2i/d), reshaped by the config's scaling (linear, llama3); float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv = 1.0 / rope.theta**exponents
    kind = (rope.scaling or {}).get("rope_type") or (rope.scaling or {}).get("type")
    if kind == "linear":
        inv = inv / rope.scaling["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, rope.scaling)
    elif kind is not None:
        raise ValueError(f"torch backend: rope scaling {kind!r} is not supported")
    return inv.to(torch.float32)


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_context = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_context / low, inv / factor, inv)
    middle = (wavelen <= old_context / low) & (wavelen >= old_context / high)
    return torch.where(middle, blended, out)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [batch, seq], shaped to broadcast over heads: [batch, seq, 1, head_dim/2]."""
    theta = positions.to(torch.float32)[:, :, None, None] * inv_freq
    return theta.cos(), theta.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim], each half-pair turned by its angle (in float32)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
