"""What the model code needs from a Hugging Face config.json, read once.

The families differ in a handful of switches (q/k norms, qkv bias, gemma's
(1 + w) norms and sandwich norms, sliding layers with their own rope base), so
one `ArchConfig` carries them and one model file reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text")


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: dict | None = None  # HF rope_scaling: linear or llama3; None = plain rope


@dataclass(frozen=True)
class ArchConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    sliding: tuple[int | None, ...]  # per layer: window in tokens, or None for full attention
    rope_full: Rope
    rope_sliding: Rope
    attn_scale: float
    qkv_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) norms, sandwich norms, gelu-tanh MLP, scaled embeddings


def _rope(params: dict | None, theta: float | None, scaling: dict | None) -> Rope:
    """transformers 5 nests theta and scaling in `rope_parameters`; older configs keep them top level."""
    params = dict(params or {})
    theta = params.pop("rope_theta", None) or theta or 10000.0
    if params.get("rope_type", "default") != "default":
        scaling = params
    if scaling and (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
        scaling = None
    return Rope(float(theta), scaling)


def _layer_windows(cfg: dict, n: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if cfg["model_type"] != "gemma3_text" or not window:
        return (None,) * n
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def read_config(folder: str | Path) -> ArchConfig:
    folder = Path(folder)
    return parse_config(json.loads((folder / "config.json").read_text()))


def parse_config(cfg: dict) -> ArchConfig:
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"torch backend: model_type {family!r} is not one of {FAMILIES}")
    n = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    gemma = family == "gemma3_text"
    rope_params = cfg.get("rope_parameters") or {}
    per_kind = "full_attention" in rope_params  # gemma3 in transformers 5: one dict per layer kind
    rope_full = _rope(
        rope_params.get("full_attention") if per_kind else rope_params,
        cfg.get("rope_theta", 1_000_000.0 if gemma else None),
        cfg.get("rope_scaling"),
    )
    rope_sliding = (
        _rope(rope_params.get("sliding_attention") if per_kind else None, cfg.get("rope_local_base_freq", 10000.0), None)
        if gemma
        else rope_full
    )
    scale_base = cfg.get("query_pre_attn_scalar", head_dim) if gemma else head_dim
    return ArchConfig(
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=n,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        sliding=_layer_windows(cfg, n),
        rope_full=rope_full,
        rope_sliding=rope_sliding,
        attn_scale=float(scale_base) ** -0.5,
        qkv_bias=family == "qwen2" or cfg.get("attention_bias", False),
        mlp_bias=cfg.get("mlp_bias", False),
        qk_norm=family in ("qwen3", "gemma3_text"),
        gemma=gemma,
    )
