"""Bring a hybrid checkpoint, in any layout it ships in, to hybrid.py's parameter names.

Layouts:
- Hugging Face (as the hub ships Qwen3.5 and Qwen3-Next): text weights under
  `model.language_model.` (Qwen3.5; Qwen3-Next under `model.`), vision tower and
  multi-token-prediction weights beside them (skipped), conv1d [C, 1, K], norms
  zero-centred. Qwen3-Next fuses q, k, v, z (and b, a) per key head and keeps
  one tensor per expert; Qwen3.5-MoE stacks experts as gate_up_proj / down_proj.
- mlx-community (mlx-lm's `sanitize` applied): conv1d [C, K, 1], norms with the 1
  added, experts stacked as switch_mlp.{gate,up,down}_proj.
"""

from __future__ import annotations

import torch

from kvfork.backends.torch.config import HybridConfig

SKIPPED = ("model.visual.", "visual.", "vision_tower.", "mtp.", "model.mtp.")
# Norms stored zero-centred by Hugging Face (x * (1 + w)) and with the 1 added by mlx-lm.
CENTRED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")


def canonical(cfg: HybridConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights named and shaped as hybrid.HybridTransformer's state dict."""
    out = {}
    for name, w in weights.items():
        if name.startswith(SKIPPED):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = w
    mlx_layout = any(name.endswith("conv1d.weight") and w.shape[-1] == 1 for name, w in out.items())
    if mlx_layout:
        for name, w in out.items():
            if name.endswith("conv1d.weight"):
                out[name] = w.transpose(1, 2)
            elif name.endswith(CENTRED_NORMS):
                out[name] = w - 1.0
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        if cfg.linear[i] and prefix + "linear_attn.in_proj_qkvz.weight" in out:
            _split_qwen3_next_projections(cfg, out, prefix + "linear_attn.")
        if cfg.moe[i]:
            _stack_experts(cfg, out, prefix + "mlp.")
    return out


def _split_qwen3_next_projections(cfg: HybridConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
    """Qwen3-Next groups [q, k, v, z] rows per key head (and [b, a]); Qwen3.5 keeps each whole."""
    nk, dk, dv, group = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_v_heads // cfg.linear_k_heads
    qkvz = w.pop(prefix + "in_proj_qkvz.weight")
    q, k, v, z = qkvz.reshape(nk, -1, qkvz.shape[-1]).split([dk, dk, group * dv, group * dv], dim=1)
    w[prefix + "in_proj_qkv.weight"] = torch.cat([t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v)])
    w[prefix + "in_proj_z.weight"] = z.reshape(-1, qkvz.shape[-1])
    ba = w.pop(prefix + "in_proj_ba.weight")
    b, a = ba.reshape(nk, 2 * group, -1).split([group, group], dim=1)
    w[prefix + "in_proj_b.weight"] = b.reshape(-1, ba.shape[-1])
    w[prefix + "in_proj_a.weight"] = a.reshape(-1, ba.shape[-1])


def _stack_experts(cfg: HybridConfig, w: dict[str, torch.Tensor], prefix: str) -> None:
    fused = prefix + "experts.gate_up_proj"
    if fused in w:  # Qwen3.5-MoE: already stacked
        return
    if prefix + "switch_mlp.gate_proj.weight" in w:  # mlx-lm
        gate, up, down = (w.pop(f"{prefix}switch_mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
    else:  # one tensor per expert
        gate, up, down = (
            torch.stack([w.pop(f"{prefix}experts.{e}.{p}.weight") for e in range(cfg.num_experts)])
            for p in ("gate_proj", "up_proj", "down_proj")
        )
    w[fused] = torch.cat((gate, up), dim=1)
    w[prefix + "experts.down_proj"] = down
