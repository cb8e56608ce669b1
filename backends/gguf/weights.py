"""GGUF llama weights -> Hugging Face llama tensors in float32.

`mx.load` reads a GGUF's legacy quants (Q4_0, Q4_1, Q8_0) straight into MLX's
own affine format: packed uint32 `weight` plus float16 `scales` and `biases`
per group of 32. Every ggml value is q * d + m with d and m float16, so after
upcasting scales and biases to float32 the dequantized values are exact: they
equal gguf's reference dequantization bit for bit (tests/test_default_model.py).
"""

from __future__ import annotations

import re

import mlx.core as mx

GGML_GROUP_SIZE = 32

# GGUF tensor names (within a block) -> Hugging Face llama names.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)$")


def hf_name(gguf_base: str) -> str:
    """'blk.3.attn_q' -> 'model.layers.3.self_attn.q_proj' (no '.weight' suffix)."""
    if gguf_base in _TOP_NAMES:
        return _TOP_NAMES[gguf_base]
    match = _BLOCK.match(gguf_base)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_base!r} for a llama model")
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}"


def dequantize(tensors: dict[str, mx.array], base: str) -> mx.array:
    """The float32 value of GGUF tensor `base`, quantized (weight/scales/biases) or not."""
    weight = tensors[f"{base}.weight"]
    scales = tensors.get(f"{base}.scales")
    if scales is None:
        return weight.astype(mx.float32)
    # The group size is fixed by ggml; the bit width follows from the packing.
    bits = weight.shape[-1] // scales.shape[-1]
    return mx.dequantize(
        weight,
        scales.astype(mx.float32),
        tensors[f"{base}.biases"].astype(mx.float32),
        group_size=GGML_GROUP_SIZE,
        bits=bits,
    )


def unpermute_rope(weight: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from the Hugging Face
    "rotate half" layout to interleaved pairs: rows viewed as (head, 2, half)
    become (head, half, 2). Swapping those axes back restores the HF layout.
    """
    rows, cols = weight.shape
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_llama_weights(tensors: dict[str, mx.array], n_heads: int, n_kv_heads: int) -> dict[str, mx.array]:
    """All tensors of a llama GGUF, renamed to Hugging Face names, float32, q/k restored."""
    bases = sorted({name.rsplit(".", 1)[0] for name in tensors})
    out: dict[str, mx.array] = {}
    for base in bases:
        value = dequantize(tensors, base)
        if base.endswith(".attn_q"):
            value = unpermute_rope(value, n_heads)
        elif base.endswith(".attn_k"):
            value = unpermute_rope(value, n_kv_heads)
        out[f"{hf_name(base)}.weight"] = value
    return out
