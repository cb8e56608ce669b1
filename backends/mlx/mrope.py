"""Qwen2.5-VL's M-RoPE on MLX: mlx-lm's qwen2 model (the folder's text model) turns queries and keys by
`self.rope(x, offset=cache.offset)` and takes no positions, so each layer's rope is wrapped (`MRoPE`) to read
them from a `Placement` the backend sets while a step runs.

A prefill chunk is placed by its three positions a token (backends/torch/images.py's `mrope_positions`: an
image's tokens by their grid, the text after it from the image's first position + max(h, w)): frequency d
turned by the position of its section, temporal, height and width in turn, as transformers' Qwen2.5-VL does.
A decode (or verify) step holds text alone, whose three positions are equal: mlx-lm's rope at the cache's
offset plus each row's shift (backends/vision/positions.py).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def mrope_section(text_config: dict) -> tuple[int, ...]:
    """The rotary sections (temporal, height, width) of a text_config: transformers 5 writes them in
    `rope_parameters`, older configs in `rope_scaling`; () for a model of plain RoPE."""
    for key in ("rope_parameters", "rope_scaling"):
        section = (text_config.get(key) or {}).get("mrope_section")
        if section:
            return tuple(section)
    return ()


class Placement:
    """Where the running step's tokens are turned: `chunk` (its first slot, its positions [3, n]) while a prefill
    chunk runs; else mlx-lm's offsets plus `shift` (a decode step's, one a batch row [rows], or 0)."""

    def __init__(self) -> None:
        self.chunk: tuple[int, mx.array] | None = None
        self.shift: int | mx.array = 0


class MRoPE(nn.Module):
    """mlx-lm's rope of one attention layer, turning by the `Placement`'s positions."""

    def __init__(self, rope: nn.Module, section: Sequence[int], base: float, placement: Placement):
        super().__init__()
        self.rope = rope
        self.placement = placement
        half = sum(section)
        self._which = mx.array(np.repeat(np.arange(len(section)) % 3, section))  # each frequency's position
        self._inv_freq = mx.array(base ** (-np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half)), mx.float32)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.placement.chunk is None:
            return self.rope(x, offset=offset + self.placement.shift)
        start, positions = self.placement.chunk
        at = int(offset) - start  # a chunk may run in pieces (checkpoints): the piece's own positions
        theta = positions[self._which, at:at + x.shape[-2]].T * self._inv_freq  # [n, head_dim / 2]
        cos, sin = mx.cos(theta), mx.sin(theta)
        half = theta.shape[-1]
        x1, x2 = x[..., :half].astype(mx.float32), x[..., half:].astype(mx.float32)
        return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def wrap(model: nn.Module, section: Sequence[int], base: float) -> Placement:
    """Each layer's rope of mlx-lm's `model` wrapped; the Placement they read."""
    placement = Placement()
    for layer in model.model.layers:
        layer.self_attn.rope = MRoPE(layer.self_attn.rope, section, base, placement)
    return placement
