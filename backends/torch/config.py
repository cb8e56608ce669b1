"""What the model code needs from a Hugging Face config.json, read once.

The families differ in a handful of switches (q/k norms, qkv bias, gemma's
(1 + w) norms and sandwich norms, sliding layers with their own rope base), so
one `ArchConfig` carries them and one model file reads them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kvfork.backends import rope_scaling
from kvfork.backends.vision import vision_family

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text")
# Vision-language models whose text model is one of FAMILIES and reads images in its own way (images.py)
VISION_FAMILIES = {"qwen2_5_vl": "qwen2", "gemma3": "gemma3_text"}
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # Gated DeltaNet + gated attention (hybrid.py)
# Mamba-style and short-convolution hybrids: served by the MLX backend through mlx-lm only.
MLX_ONLY_FAMILIES = ("lfm2", "lfm2_moe", "nemotron_h", "granitemoehybrid", "falcon_h1", "jamba", "mamba2")


@dataclass(frozen=True)
class Rope:
    theta: float
    scaling: dict | None = None  # HF rope_scaling (backends/rope_scaling.py); None = plain rope
    max_positions: int = 0  # the model's context: YaRN and LongRoPE derive a missing factor from it


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
    # M-RoPE (Qwen2.5-VL): the rotary frequencies in three sections turned by a token's temporal, height and
    # width positions (images.py); empty: one position per token
    mrope_section: tuple[int, ...] = ()
    bidirectional_images: bool = False  # an image's tokens attend each other both ways (Gemma 3)


def _rope(params: dict | None, theta: float | None, scaling: dict | None, max_positions: int = 0) -> Rope:
    """transformers 5 nests theta and scaling in `rope_parameters`; older configs keep them top level."""
    params = dict(params or {})
    theta = params.pop("rope_theta", None) or theta or 10000.0
    if params.get("rope_type", "default") != "default":
        scaling = params
    if rope_scaling.kind(scaling) is None:
        scaling = None
    reason = rope_scaling.refusal(scaling)
    if reason is not None:
        raise ValueError(f"torch backend: {reason}")
    return Rope(float(theta), scaling, max_positions)


def _layer_windows(cfg: dict, n: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if cfg["model_type"] != "gemma3_text" or not window:
        return (None,) * n
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = cfg.get("sliding_window_pattern", 6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def read_config(folder: str | Path) -> ArchConfig | HybridConfig:
    folder = Path(folder)
    return parse_config(json.loads((folder / "config.json").read_text()))


def parse_config(cfg: dict) -> ArchConfig | HybridConfig:
    if cfg.get("model_type") in VISION_FAMILIES:  # their text models read images in their own ways
        return parse_vision_text_config(cfg)
    if vision_family(cfg) is not None:  # a vision model: its text model (the tower: backends/torch/vision.py)
        cfg = cfg["text_config"]
    family = cfg.get("model_type")
    if family in HYBRID_FAMILIES:
        return parse_hybrid_config(cfg)
    if family in MLX_ONLY_FAMILIES:
        raise ValueError(f"torch backend: {family!r} (a Mamba-style hybrid) is served by the MLX backend only")
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
        cfg.get("max_position_embeddings", 0),
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


def parse_vision_text_config(cfg: dict) -> ArchConfig:
    """A vision-language model's text model: its `text_config` over the top level (older checkpoints keep
    the text model's settings there), read as its text family, with M-RoPE's sections taken out of its
    rope parameters (transformers spells their type 'mrope' or 'default')."""
    family = cfg["model_type"]
    text = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text |= cfg.get("text_config") or {}
    text["model_type"] = VISION_FAMILIES[family]
    section: tuple[int, ...] = ()
    for key in ("rope_scaling", "rope_parameters"):
        params = dict(text.get(key) or {})
        if "mrope_section" in params:
            section = tuple(params.pop("mrope_section"))
            params.pop("mrope_interleaved", None)
            if params.get("rope_type", params.get("type")) in ("mrope", "default"):
                params.pop("type", None)
                params["rope_type"] = "default"
            text[key] = params
    arch = parse_config(text)
    if not isinstance(arch, ArchConfig):
        raise ValueError(f"torch backend: {family!r} has a text model of another kind than {FAMILIES}")
    if section and sum(section) != arch.head_dim // 2:
        raise ValueError(f"torch backend: mrope_section {list(section)} does not cover head_dim {arch.head_dim} / 2")
    return dataclasses.replace(arch, family=family, mrope_section=section, bidirectional_images=arch.gemma)


# -- hybrids: Gated DeltaNet layers beside gated full attention ----------------


@dataclass(frozen=True)
class HybridConfig:
    """Qwen3.5 (dense, MoE) and Qwen3-Next: `linear[i]` says layer i is a Gated DeltaNet
    layer (else gated full attention), `moe[i]` that its MLP is routed experts."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # partial rotary: only the first rotary_dim of each head turn
    norm_eps: float
    rope: Rope
    linear: tuple[bool, ...]
    linear_k_heads: int
    linear_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    conv_kernel: int
    moe: tuple[bool, ...]
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True


def parse_hybrid_config(cfg: dict) -> HybridConfig:
    """Qwen3.5 nests the text model's settings under `text_config` (beside a vision config
    we skip); Qwen3-Next keeps them top level. Quantized conversions are MLX's own format."""
    family = cfg["model_type"]
    if "quantization" in cfg or "quantization_config" in cfg:
        raise ValueError(f"torch backend: {family!r} checkpoint is quantized; load the float checkpoint, "
                         "or serve this conversion with the MLX backend")
    text = cfg.get("text_config", cfg)
    n = text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rope_params = dict(text.get("rope_parameters") or {})
    partial = rope_params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    kinds = text.get("layer_types")
    interval = text.get("full_attention_interval", 4)
    if kinds:
        linear = tuple(kind == "linear_attention" for kind in kinds)
    else:
        linear = tuple((i + 1) % interval != 0 for i in range(n))
    experts = text.get("num_experts", 0) or 0
    if family == "qwen3_next":  # every decoder_sparse_step-th layer, less mlp_only_layers
        step, dense_only = text.get("decoder_sparse_step", 1), set(text.get("mlp_only_layers", []))
        moe = tuple(experts > 0 and (i + 1) % step == 0 and i not in dense_only for i in range(n))
    else:
        moe = (experts > 0,) * n
    for key in ("mrope_section", "mrope_interleaved", "partial_rotary_factor"):
        rope_params.pop(key, None)  # text-only positions: M-RoPE's three sections turn alike
    return HybridConfig(
        family=family,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text.get("intermediate_size", 0),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        norm_eps=text.get("rms_norm_eps", 1e-6),
        rope=_rope(rope_params, text.get("rope_theta"), text.get("rope_scaling"),
                   text.get("max_position_embeddings", 0)),
        linear=linear,
        linear_k_heads=text["linear_num_key_heads"],
        linear_v_heads=text["linear_num_value_heads"],
        linear_k_dim=text["linear_key_head_dim"],
        linear_v_dim=text["linear_value_head_dim"],
        conv_kernel=text.get("linear_conv_kernel_dim", 4),
        moe=moe,
        num_experts=experts,
        experts_per_token=text.get("num_experts_per_tok", 0),
        moe_intermediate_size=text.get("moe_intermediate_size", 0),
        shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 0),
        norm_topk_prob=text.get("norm_topk_prob", family != "qwen3_next"),
    )
