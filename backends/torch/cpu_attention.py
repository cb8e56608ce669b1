"""torch's fused CPU attention with its log-sum-exp: the one adapter to that private op.

`scaled_dot_product_attention` returns the output alone; the op beneath it on the CPU also returns the
log-sum-exp of each query's scores, which two attentions over disjoint keys need to be merged into one
(attention.py, `chunk_after_keys`)."""

from __future__ import annotations

import torch


def attention_with_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, heads, n, head_dim] over keys and values [1, heads, n_keys, head_dim] (causal: aligned to the
    first key, as for a square block). Returns the output [1, heads, n, head_dim] and the log-sum-exp of
    the scores [1, heads, n] (float32)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, causal, scale=scale)
