"""RoPE scaling as transformers computes it, for every backend that reads a config.

transformers' `ROPE_INIT_FUNCTIONS` give each scaling's inverse frequencies and its
attention factor (the scale YaRN and LongRoPE put on cos and sin): the torch backend
takes both from there, and mlx-lm's models compute the same for these kinds.

Frequencies must not depend on the sequence's length: kvfork reuses KV computed for a
prefix, which is exact only if a token's rotation is fixed once computed. So dynamic
NTK (frequencies rescaled as the sequence grows) is refused, and LongRoPE always uses
its long factors (as mlx-lm does; transformers switches from the short ones past
`original_max_position_embeddings`, which would change a prefix's keys mid-session).
"""

from __future__ import annotations

from typing import Any

SERVED = ("linear", "llama3", "yarn", "longrope")


def kind(scaling: dict[str, Any] | None) -> str | None:
    """The scaling's type, None for plain RoPE (transformers 5 spells that 'default')."""
    if not scaling:
        return None
    name = scaling.get("rope_type") or scaling.get("type")
    return None if name in (None, "default") else name


def length_refusal(scaling: dict[str, Any] | None) -> str | None:
    """Why no backend serves this scaling (its frequencies depend on the sequence's length), or None."""
    if kind(scaling) != "dynamic":
        return None
    return ("rope scaling 'dynamic' (dynamic NTK) rescales every position's frequencies as the sequence grows, "
            "so KV reused from a shorter prefix would not be what the model computes; kvfork refuses it "
            f"(it serves {', '.join(SERVED)})")


def refusal(scaling: dict[str, Any] | None) -> str | None:
    """Why the torch backend cannot serve a model with this scaling, or None when it can."""
    name = kind(scaling)
    if name is None or name in SERVED:
        return None
    return length_refusal(scaling) or f"rope scaling {name!r} is not one the torch backend serves ({', '.join(SERVED)})"


def frequencies(scaling: dict[str, Any], theta: float, head_dim: int, max_positions: int):
    """(inverse frequencies as a float32 torch tensor [head_dim / 2], attention factor) from transformers."""
    from transformers import PreTrainedConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    reason = refusal(scaling)
    if reason is not None:
        raise ValueError(reason)
    name = kind(scaling)
    params = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": name, "rope_theta": theta}
    config = PreTrainedConfig(head_dim=head_dim, hidden_size=head_dim, num_attention_heads=1,
                              max_position_embeddings=max_positions, rope_parameters=params)
    # LongRoPE: the long factors at every length (module docstring), which transformers picks past the original context.
    seq_len = params.get("original_max_position_embeddings", 0) + 1 if name == "longrope" else None
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[name](config, "cpu", seq_len=seq_len)
    return inv_freq.float(), float(attention_factor)
