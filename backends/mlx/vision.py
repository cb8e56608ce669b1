"""Reading images on MLX: mlx-lm's model of a vision folder's text model (its `text_config`), fed the image keys'
embeddings as `input_embeddings`, and the torch backend's tower and encoder cache (backends/torch/vision.py:
transformers' modules on the CPU) computing them.

Why transformers' towers under MLX and not mlx-vlm's: mlx-vlm pins mlx and brings opencv, fastapi and mlx-audio
with it, while transformers' towers already run here for the torch backend; so one tower and one encoder cache
(by scope and the server's pixel hash) serve both backends, and both read the same embeddings. The text model,
its KV state, batching, clones and the budget are the MLX backend's as for any text model. torch is a Linux
dependency (pyproject.toml): where it does not import, a vision model is refused, naming what to do.

Families: idefics3 (SmolVLM; llama text, its image tokens placed as text). Gemma 3 (an image's tokens attend
each other both ways) and Qwen2.5-VL (M-RoPE positions) need a mask and positions mlx-lm's models take no
argument for: they are refused, naming --backend torch.
"""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import MODEL_REMAPPING, load_model, load_tokenizer

from kvfork.backends.vision import ImageInput
from kvfork.backends.vision.keys import IMAGE_KEY_BASE

SERVED = ("idefics3",)  # the vision families (backends/vision FAMILIES) MLX reads images of


def refusal(folder: Path, family: str) -> str | None:
    """Why MLX cannot serve the vision model in `folder` of `family`, or None when it can."""
    if family not in SERVED:
        return (f"{folder.name} reads images ({family}): the MLX backend reads images of {', '.join(SERVED)} "
                "only; serve it with --backend torch")
    try:
        import torch  # noqa: F401  (the tower's)
    except ImportError:
        return (f"{folder.name} reads images ({family}): its vision tower runs on torch (transformers' modules), "
                "which does not import here; serve it with --backend torch where torch is installed")
    return None


def load_text_model(folder: Path) -> tuple[nn.Module, Any]:
    """(mlx-lm's model of the folder's text model, holding the checkpoint's text weights; its tokenizer)."""
    from kvfork.backends.torch.loading import text_name
    from kvfork.backends.torch.vision import split_weights

    text_config = json.loads((folder / "config.json").read_text())["text_config"]

    def classes(config: dict) -> tuple[type, type]:
        kind = config["model_type"]
        module = import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(kind, kind)}")

        base = module.Model

        def sanitize(self: Any, weights: dict) -> dict:
            """The text model's weights under a text checkpoint's names; the tower's left to it."""
            text, _ = split_weights(folder, {text_name(k): w for k, w in weights.items()}, False)
            return base.sanitize(self, text) if hasattr(base, "sanitize") else text

        return type("TextModel", (base,), {"sanitize": sanitize}), module.ModelArgs

    model, config = load_model(folder, model_config=text_config, get_model_classes=classes)
    return model, load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))


class MLXVisionReader:
    """The torch backend's tower and encoder cache, its embeddings handed to the text model as mx arrays."""

    def __init__(self, folder: Path, model: nn.Module):
        import torch

        from kvfork.backends.torch.loading import read_weights
        from kvfork.backends.torch.vision import VisionReader, split_weights

        _, tower = split_weights(folder, read_weights(folder, torch.device("cpu")), False)
        assert tower is not None, f"{folder} is no vision model"
        self.reader = VisionReader(folder, tower, torch.device("cpu"), torch.float32)
        self.embed = model.model.embed_tokens  # mlx-lm's text models: an inner `model` with `embed_tokens`
        self.dtype = self.embed.weight.dtype

    def encode(self, images: Sequence[ImageInput], scope: str) -> int:
        return self.reader.encode(images, scope)

    def release(self, images: Sequence[int]) -> None:
        self.reader.release(images)

    def check(self, chunks: Sequence[Sequence[int]]) -> None:
        """ValueError where a chunk holds a key of an image no running request holds (`encode`)."""
        self.reader.check(chunks)

    def inputs(self, chunk: Sequence[int], start: int) -> tuple[mx.array, mx.array | None]:
        """A chunk written from position `start`: its ids [1, n] (keys as the image placeholder) and, where it
        holds image keys, its input embeddings [1, n, hidden] (the tokens' own, the images' rows at their keys);
        the chunk was `check`ed."""
        if all(t < IMAGE_KEY_BASE for t in chunk):
            return mx.array(list(chunk))[None], None
        ids, placed = self.reader.place(chunk, start)
        tokens = mx.array(ids)[None]
        rows = np.zeros((len(chunk), self.embed.weight.shape[-1]), np.float32)
        seen = np.zeros((len(chunk), 1), bool)
        for image in placed:  # positions as text: each run's rows from its first slot (grid None)
            at = image.start - start
            rows[at:at + image.tokens] = image.embeddings.float().numpy()
            seen[at:at + image.tokens] = True
        embedded = mx.where(mx.array(seen), mx.array(rows).astype(self.dtype), self.embed(tokens)[0])
        return tokens, embedded[None]
