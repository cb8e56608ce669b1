"""What each GGUF architecture kvfork serves becomes: config.json and Hugging Face tensor names.

llama.cpp's converter writes each family's Hugging Face config as `<arch>.*` keys and renames
its tensors; here both are turned back. Its changes to the values are undone too: llama's q/k
rows are permuted to interleaved pairs (`unpermute_rope`), gemma's zero-centred norms have 1
added, and a Llama 3 rope scaling is stored as a `rope_freqs` tensor of per-frequency factors
(`_llama3_scaling` finds the transformers parameters that give exactly those factors).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from kvfork.backends.rope_scaling import frequencies
from kvfork.backends.gguf.reader import GGUFFile, UnservableGGUF, dequantized

# GGUF architecture -> (model_type, architectures entry).
FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# llama.cpp permutes q/k rows of these (its converter's `undo_permute`); qwen's it leaves alone.
PERMUTED = ("llama",)

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# gemma's sandwich norms: its `ffn_norm` comes before the MLP, as in the others, but is named for it.
_GEMMA_BLOCK_NAMES = dict(_BLOCK_NAMES, post_attention_norm="post_attention_layernorm",
                          ffn_norm="pre_feedforward_layernorm", post_ffw_norm="post_feedforward_layernorm")
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"(\w+)\.(weight|bias)$")
ROPE_FREQS = "rope_freqs.weight"  # not a parameter: Llama 3's rope scaling, read into the config


def hf_name(arch: str, gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    names = _GEMMA_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    block = _BLOCK.match(gguf_name)
    if block and block.group(2) in names:
        return f"model.layers.{block.group(1)}.{names[block.group(2)]}.{block.group(3)}"
    top = _TOP.match(gguf_name)
    if not block and top and top.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[top.group(1)]}.{top.group(2)}"
    raise UnservableGGUF(f"the GGUF holds tensor {gguf_name}, which kvfork does not know where to put")


def unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: each head's rows, viewed as (2, half) in the
    Hugging Face "rotate half" layout, were reordered to (half, 2); swapping back restores them."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def as_checkpoint(g: GGUFFile, gguf_name: str, value: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """A dequantized tensor as the Hugging Face checkpoint held it."""
    for kind, heads in (("q", config["num_attention_heads"]), ("k", config["num_key_value_heads"])):
        if g.arch in PERMUTED and re.search(rf"\.attn_{kind}\.(weight|bias)$", gguf_name):
            if value.shape[0] % (2 * heads):
                raise UnservableGGUF(f"the GGUF's tensor {gguf_name} has {value.shape[0]} rows, not a pair of "
                                     f"halves for each of its {heads} heads")
            return unpermute_rope(value, heads)
    if g.arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return value - np.float32(1.0)  # llama.cpp stores gemma's (1 + w) norms with the 1 added
    return value


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """config.json for the file (less its tokenizer's special ids), or UnservableGGUF naming what is missing."""
    if g.arch not in FAMILIES:
        raise UnservableGGUF(f"GGUF architecture {g.arch or '(none stated)'!r} is not one kvfork serves "
                             f"(it serves {', '.join(FAMILIES)})")
    model_type, class_name = FAMILIES[g.arch]
    heads, hidden = _count(g, "attention.head_count"), _count(g, "embedding_length")
    if isinstance(g.key("attention.head_count_kv"), list):
        raise UnservableGGUF("the GGUF gives each layer its own KV head count, which these families never do")
    kv_heads = _count(g, "attention.head_count_kv", heads)
    head_dim = _count(g, "attention.key_length", hidden // heads)
    if g.key("rope.dimension_count", head_dim, int) != head_dim:
        raise UnservableGGUF("the GGUF turns only part of each head (partial rotary), which these families never do")
    layers = _count(g, "block_count")
    held = {int(block.group(1)) for name in g.tensors if (block := _BLOCK.match(name))}
    if len(held) != layers or max(held) != layers - 1:  # distinct indices from 0: exactly 0 .. layers - 1
        raise UnservableGGUF(f"the GGUF states {layers} blocks ({g.arch}.block_count) but holds tensors of "
                             f"{len(held)}")
    config = {
        "architectures": [class_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _count(g, "feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest(_required(g, "attention.layer_norm_rms_epsilon", float)),
        # Top level on purpose: mlx-lm's llama reads `rope_theta` and `rope_scaling` here.
        "rope_theta": _shortest(g.key("rope.freq_base", 10000.0, float)),
        "rope_scaling": rope_scaling(g, head_dim),
        "max_position_embeddings": _count(g, "context_length"),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": g.arch == "qwen2",
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    return config | _gemma3(g, config) if g.arch == "gemma3" else config


def _gemma3(g: GGUFFile, config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own settings. What the file does not state, llama.cpp fixes as kvfork does here: every
    sixth layer full, the sliding layers' rope base 10000, and the query scale 1/sqrt(head_dim) except
    for the 27B model (62 layers), which scales by 1/sqrt(hidden / heads)."""
    n = config["num_hidden_layers"]
    pattern = g.key("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer, True for a sliding one; mlx-lm takes the period
        g.key("attention.sliding_window_pattern", kind=list[bool])
        period = pattern.index(False) + 1 if False in pattern else n + 1
        if pattern != [(i + 1) % period != 0 for i in range(n)]:
            raise UnservableGGUF("the GGUF's sliding layers do not repeat every few layers, as Gemma 3's do")
        pattern = period
    else:
        pattern = _count(g, "attention.sliding_window_pattern", 6)
    full = [(i + 1) % pattern == 0 for i in range(n)]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _count(g, "attention.sliding_window"),
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if f else "sliding_attention" for f in full],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": config["hidden_size"] // config["num_attention_heads"] if n == 62
        else config["head_dim"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": True,
    }


def rope_scaling(g: GGUFFile, head_dim: int) -> dict[str, Any] | None:
    """The transformers `rope_scaling` the file's rope keys (or its rope_freqs tensor) stand for."""
    kind = g.key("rope.scaling.type", "none", str)
    factor = g.key("rope.scaling.factor", 1.0, float)
    if ROPE_FREQS in g.tensors:
        if kind != "none":
            raise UnservableGGUF(f"the GGUF has both rope_freqs and {kind} rope scaling, which no llama.cpp "
                                 "model writes")
        return _llama3_scaling(g, head_dim)
    if kind == "none" or factor == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _shortest(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": _shortest(factor),
                   "original_max_position_embeddings": _count(g, "rope.scaling.original_context_length")}
        for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if g.key(f"rope.scaling.{key}") is not None:
                scaling[ours] = _shortest(g.key(f"rope.scaling.{key}", kind=float))
        return scaling
    raise UnservableGGUF(f"the GGUF's rope scaling {kind!r} is not one kvfork reads from a GGUF (linear, yarn)")


def _llama3_scaling(g: GGUFFile, head_dim: int) -> dict[str, Any]:
    """Llama 3.1's rope parameters, checked to give the file's per-frequency factors (to float32 rounding).

    The file keeps only the factors; every Llama 3.x checkpoint used low 1, high 4 and an
    original context of 8192, with the largest factor as `factor`."""
    factors = dequantized(g.tensors[ROPE_FREQS]).astype(np.float64)
    scaling = {"rope_type": "llama3", "factor": _shortest(factors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    theta = _shortest(g.key("rope.freq_base", 10000.0, float))
    scaled, _ = frequencies(scaling, theta, head_dim, max_positions=0)
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != plain.shape or not np.allclose(plain / scaled.double().numpy(), factors, rtol=1e-4):
        raise UnservableGGUF("the GGUF's rope_freqs factors are not Llama 3's rope scaling, the only kind kvfork "
                             "reads from that tensor")
    return scaling


def _required(g: GGUFFile, name: str, kind: Any) -> Any:
    value = g.key(name, kind=kind)
    if value is None:
        raise UnservableGGUF(f"the GGUF lacks {g.arch}.{name}")
    return value


def _count(g: GGUFFile, name: str, default: int | None = None) -> int:
    """A size or count: a positive integer (the file's own when it states one, else `default`)."""
    value = _required(g, name, int) if default is None else g.key(name, default, int)
    if value <= 0:
        raise UnservableGGUF(f"the GGUF's {g.arch}.{name} is {value}, where a positive count belongs")
    return value


def _shortest(value: float) -> float:
    """A float32 GGUF value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))
