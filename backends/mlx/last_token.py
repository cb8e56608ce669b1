"""Prefill logits for the last token only.

mlx-lm models return logits for every position, and MLX does not push a
slice back through the output projection: for SmolLM2 (49,152-token vocab,
576 wide) that projection is about 15% of a 512-token prefill, spent on rows
nobody reads. Most mlx-lm models are an inner `model` (embeddings, layers,
norm) plus a head, some (Qwen3.5) inside a `language_model` beside a vision
tower; while a chunk runs, a stand-in for the inner model hands the head only
the last position. Whether a model is built that way is checked once, on a
short input, against the plain call; other models run plainly. (Qwen3.5's
248,320-token head is most of a 0.8B model's prefill.)
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class _LastPosition(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)[:, -1:]

    def __getattr__(self, name):
        if name in self:
            return self[name]
        if "inner" in self:
            return getattr(self["inner"], name)  # the head may read the inner's embeddings
        raise AttributeError(name)


def _owner(model: nn.Module) -> nn.Module:
    """The module whose `model` is the inner model: the text model of a vision-language wrapper."""
    text = model.get("language_model")
    return text if isinstance(text, nn.Module) else model


def _with_last_position(model: nn.Module, tokens: mx.array, cache, embedded: mx.array | None = None) -> mx.array:
    owner = _owner(model)
    inner = owner["model"]
    owner["model"] = _LastPosition(inner)
    try:
        return _call(model, tokens, cache, embedded)[:, -1]
    finally:
        owner["model"] = inner


def supports_last_position(model: nn.Module) -> bool:
    if not isinstance(_owner(model).get("model"), nn.Module):
        return False
    tokens = mx.array([[1, 2, 3]])
    try:
        fast = _with_last_position(model, tokens, None)
    except (ValueError, TypeError, IndexError, AttributeError):
        return False
    plain = model(tokens)[:, -1]
    # A structural check (is it the last position's row?), loose enough for bf16.
    return fast.shape == plain.shape and mx.abs(fast - plain).max().item() <= 1e-2 * (mx.abs(plain).max().item() + 1)


def _call(model: nn.Module, tokens: mx.array, cache, embedded: mx.array | None) -> mx.array:
    if embedded is None:
        return model(tokens, cache=cache)
    return model(tokens, cache=cache, input_embeddings=embedded)


def last_logits(model: nn.Module, tokens: mx.array, cache, last_only: bool,
                embedded: mx.array | None = None) -> mx.array:
    """Logits [batch, vocab] of the last position of `tokens`, committing them to `cache`; `embedded`: the
    tokens' input embeddings, where they are not the token embedding's alone (an image's: vision.py)."""
    if last_only:
        return _with_last_position(model, tokens, cache, embedded)
    return _call(model, tokens, cache, embedded)[:, -1]
