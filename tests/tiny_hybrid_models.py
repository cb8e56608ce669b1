"""Tiny random hybrid models (Qwen3.5 dense and MoE, Qwen3-Next, LFM2, Nemotron-H, Granite hybrid), written at test time
in the layouts checkpoints ship in:

- "hf": as the hub ships them. Qwen3.5's text config nested under `text_config`
  beside a vision config, its text weights under `model.language_model.` beside
  vision-tower and MTP weights (which every loader skips); conv1d [C, 1, K];
  zero-centred norms; Qwen3-Next's fused per-key-head projections and one tensor
  per expert.
- "mlx": an mlx-community conversion, i.e. what mlx-lm's `sanitize` makes of "hf".

The weights are drawn in the torch backend's own layout (its state dict names the
parameters and their shapes) and written out in each layout by the inverse of
backends/torch/checkpoints.py; mlx-lm loading both folders strictly is what checks
that the layouts are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tiny_models import write_tokenizer

HYBRID_ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
LAYOUTS = ("hf", "mlx")

_TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,  # layers 0-2 Gated DeltaNet, layer 3 full attention
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    # Untied: the head's rows of norm ~1 give logits about one unit wide. Random q and k read
    # random values out of the delta rule's state, so a DeltaNet layer's output carries
    # several times the relative float32 noise of a trained one; a tied head (rows of norm
    # ~8) would lift it over the parity tolerance (atol 1e-5).
    tie_word_embeddings=False,
    attention_bias=False,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
         "mrope_interleaved": True}
_VISION = {"depth": 1, "hidden_size": 16, "out_hidden_size": 64, "patch_size": 16}


def hybrid_config(arch: str, eos: int, head_dim: int = _TEXT["head_dim"]) -> dict:
    """config.json as the hub has it (attention heads `head_dim` wide)."""
    if arch == "qwen3_next":
        return dict(_TEXT, **_MOE, head_dim=head_dim, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], rope_theta=10000.0,
                    partial_rotary_factor=0.25, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
                    eos_token_id=eos, torch_dtype="float32")
    moe = arch == "qwen3_5_moe"
    text = dict(_TEXT, **(_MOE if moe else {}), head_dim=head_dim, model_type=f"{arch}_text", rope_parameters=dict(_ROPE),
                eos_token_id=eos)
    return {
        "model_type": arch,
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": dict(_VISION),
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _canonical_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random weights named and shaped as the torch backend's hybrid model."""
    import torch

    from kvfork.backends.torch.config import parse_config
    from kvfork.backends.torch.hybrid import HybridTransformer

    with torch.device("meta"):
        model = HybridTransformer(parse_config(config), tied=False)
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in model.state_dict().items():
        shape = tuple(p.shape)
        if name.endswith("linear_attn.norm.weight"):  # the gated norm: not zero-centred
            w = 1.0 + rng.normal(0.0, 0.1, shape)
        elif name.endswith("norm.weight"):  # zero-centred: x * (1 + w)
            w = rng.normal(0.0, 0.1, shape)
        elif name.endswith("A_log"):  # slow decays: the state remembers tens of tokens, across
            # chunks of the rule (fast ones leave little but the last token's write, whose random
            # readout is sometimes near zero, and the gated norm then lifts float32 noise ~100x)
            w = np.log(rng.uniform(0.02, 0.5, shape))
        elif name.endswith("dt_bias"):
            w = rng.uniform(-1.0, 1.0, shape)
        elif name.endswith("embed_tokens.weight"):
            w = rng.normal(0.0, 1.0, shape)
        else:
            w = rng.normal(0.0, 1.0, shape) / np.sqrt(shape[-1])
        out[name] = w.astype(np.float32)
    return out


def _fuse_qwen3_next(text: dict, w: dict[str, np.ndarray], prefix: str) -> None:
    """Inverse of checkpoints._split_qwen3_next_projections: [q, k, v, z] rows grouped per key head."""
    nk, dk, dv = text["linear_num_key_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    group = text["linear_num_value_heads"] // nk
    qkv, z = w.pop(prefix + "in_proj_qkv.weight"), w.pop(prefix + "in_proj_z.weight")
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    parts = [x.reshape(nk, -1, x.shape[-1]) for x in (q, k, v, z)]
    w[prefix + "in_proj_qkvz.weight"] = np.concatenate(parts, axis=1).reshape(-1, qkv.shape[-1])
    b, a = w.pop(prefix + "in_proj_b.weight"), w.pop(prefix + "in_proj_a.weight")
    parts = [x.reshape(nk, group, -1) for x in (b, a)]
    w[prefix + "in_proj_ba.weight"] = np.concatenate(parts, axis=1).reshape(-1, b.shape[-1])


def _layout(arch: str, layout: str, config: dict, canonical: dict[str, np.ndarray], rng) -> dict[str, np.ndarray]:
    text = config.get("text_config", config)
    w = dict(canonical)
    centred = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight", ".q_norm.weight",
               ".k_norm.weight")
    for name in list(w):
        if arch == "qwen3_next" and name.endswith("linear_attn.in_proj_qkv.weight"):
            _fuse_qwen3_next(text, w, name.removesuffix("in_proj_qkv.weight"))
    experts = [n.removesuffix("experts.gate_up_proj") for n in w if n.endswith("experts.gate_up_proj")]
    for prefix in experts:
        if layout == "hf" and arch == "qwen3_5_moe":
            continue  # the hub stacks them already
        gate, up = np.split(w.pop(prefix + "experts.gate_up_proj"), 2, axis=1)
        down = w.pop(prefix + "experts.down_proj")
        if layout == "mlx":
            for part, x in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                w[f"{prefix}switch_mlp.{part}.weight"] = x
        else:
            for e in range(text["num_experts"]):
                for part, x in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
                    w[f"{prefix}experts.{e}.{part}.weight"] = x[e]
    if layout == "mlx":
        for name in list(w):
            if name.endswith("conv1d.weight"):
                w[name] = w[name].transpose(0, 2, 1)
            elif name.endswith(centred):
                w[name] = w[name] + 1.0
        if arch != "qwen3_next":
            w = {f"language_model.{name}": x for name, x in w.items()}
        return w
    if arch != "qwen3_next":  # the text model sits beside a vision tower
        w = {name.replace("model.", "model.language_model.", 1): x for name, x in w.items()}
        w["model.visual.patch_embed.proj.weight"] = rng.normal(0, 1, (16, 3, 2, 16, 16)).astype(np.float32)
    w["mtp.fc.weight"] = rng.normal(0, 1, (64, 128)).astype(np.float32)  # multi-token prediction: unused
    return w


def write_hybrid_model(folder: Path, arch: str, layout: str = "hf", seed: int = 0,
                       head_dim: int = _TEXT["head_dim"]) -> Path:
    """Write a tiny `arch` model in `layout` ("hf" or "mlx") into `folder`; returns the folder.
    The same seed gives the same model in both layouts."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    eos = write_tokenizer(folder, _TEXT["vocab_size"], _TEXT["max_position_embeddings"])
    config = hybrid_config(arch, eos, head_dim)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = _layout(arch, layout, config, _canonical_weights(config, seed), np.random.default_rng(seed + 1))
    weights = {name: np.ascontiguousarray(w) for name, w in weights.items()}  # safetensors writes raw buffers
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt" if layout == "hf" else "mlx"})
    return folder


LFM2 = dict(
    model_type="lfm2",
    architectures=["Lfm2ForCausalLM"],
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    norm_eps=1e-5,
    conv_bias=False,
    conv_L_cache=3,
    block_dim=64,
    block_ff_dim=128,
    block_multiple_of=16,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=False,
    rope_theta=10000.0,
    layer_types=["conv", "conv", "full_attention", "conv"],
    tie_word_embeddings=True,
)


NEMOTRON_H = dict(
    model_type="nemotron_h",
    architectures=["NemotronHForCausalLM"],
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=4096,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=False,
    mamba_num_heads=4,
    mamba_head_dim=16,
    mamba_proj_bias=False,
    ssm_state_size=16,
    conv_kernel=4,
    n_groups=2,
    mlp_bias=False,
    layer_norm_epsilon=1e-5,
    use_bias=False,
    use_conv_bias=True,
    hybrid_override_pattern=["M", "-", "M", "*", "-", "M"],  # Mamba-2, MLP-only and attention blocks
    time_step_limit=[0.0, float("inf")],
    tie_word_embeddings=False,
)


GRANITE_HYBRID = dict(
    model_type="granitemoehybrid",
    architectures=["GraniteMoeHybridForCausalLM"],
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    shared_intermediate_size=128,
    num_hidden_layers=4,
    max_position_embeddings=4096,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=False,
    embedding_multiplier=1.0,
    attention_multiplier=0.25,
    logits_scaling=1.0,
    residual_multiplier=1.0,
    layer_types=["mamba", "mamba", "attention", "mamba"],
    rms_norm_eps=1e-5,
    mamba_n_heads=8,  # transformers checks heads x head dim = 2 x hidden
    mamba_d_head=16,
    mamba_proj_bias=False,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_n_groups=1,
    mamba_conv_bias=True,
    tie_word_embeddings=False,
)


def write_granite_hybrid_model(folder: Path, seed: int = 0) -> Path:
    """A tiny Granite 4 hybrid, dense (Mamba-2 beside attention): MLX only."""
    return write_mlx_only_model(folder, GRANITE_HYBRID, seed)


def write_lfm2_model(folder: Path, seed: int = 0) -> Path:
    """A tiny LFM2 (short convolutions beside attention): MLX only."""
    return write_mlx_only_model(folder, LFM2, seed)


def write_nemotron_h_model(folder: Path, seed: int = 0) -> Path:
    """A tiny Nemotron-H (Mamba-2 beside attention and MLP-only blocks): MLX only."""
    return write_mlx_only_model(folder, NEMOTRON_H, seed)


# Families only MLX serves, written in mlx layout only: there is no torch model to draw them from.
MLX_ONLY_WRITERS = {"lfm2": write_lfm2_model, "nemotron_h": write_nemotron_h_model,
                    "granitemoehybrid": write_granite_hybrid_model}
MLX_ONLY_ARCHS = tuple(MLX_ONLY_WRITERS)


def write_mlx_only_model(folder: Path, config: dict, seed: int = 0) -> Path:
    """A tiny model of a family only MLX serves, in mlx layout: shapes from mlx-lm's own class."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes
    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(config, eos_token_id=write_tokenizer(folder, config["vocab_size"], config["max_position_embeddings"]))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            w = 1.0 + rng.normal(0.0, 0.1, shape)
        elif name.endswith("embed_tokens.weight") or name.endswith("embeddings.weight"):
            w = rng.normal(0.0, 1.0, shape)
        elif name.endswith("A_log"):  # slow decays, as the delta rule's above
            w = np.log(rng.uniform(0.02, 0.5, shape))
        else:
            w = rng.normal(0.0, 1.0, shape) / np.sqrt(shape[-1])
        weights[name] = w.astype(np.float32)
    del model
    mx.clear_cache()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "mlx"})
    return folder
