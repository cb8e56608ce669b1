"""Reading images on MLX: mlx-lm's model of a vision folder's text model (its `text_config`), fed the image keys'
embeddings as `input_embeddings`, and the torch backend's tower and encoder cache (backends/torch/vision.py:
transformers' modules on the CPU) computing them.

Why transformers' towers under MLX and not mlx-vlm's: mlx-vlm pins mlx and brings opencv, fastapi and mlx-audio
with it, while transformers' towers already run here for the torch backend; so one tower and one encoder cache
(by scope and the server's pixel hash) serve both backends, and both read the same embeddings. The text model,
its KV state, batching, clones and the budget are the MLX backend's as for any text model. torch is a Linux
dependency (pyproject.toml): where it does not import, a vision model is refused, naming what to do.

Families: idefics3 (SmolVLM; llama text, its image tokens placed as text) and gemma3 (an image's tokens attend
each other both ways in prefill: each layer is wrapped to add the image's block to mlx-lm's causal mask,
`BothWays`; Gemma scales its input embeddings by sqrt(hidden), which the image's rows do not take, so they
enter divided by it) and qwen2_5_vl (Qwen2.5-VL: qwen2 text, its tokens placed by M-RoPE, each layer's rope
wrapped to take their positions, mrope.py; a session keeps its M-RoPE shifts, backends/vision/positions.py).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from importlib import import_module
from pathlib import Path
from typing import Any, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.utils import MODEL_REMAPPING, load_model, load_tokenizer

from kvfork.backends.mlx import mrope
from kvfork.backends.vision import ImageInput
from kvfork.backends.vision.positions import RopeShifts, shift_at
from kvfork.backends.vision.keys import IMAGE_KEY_BASE

SERVED = ("idefics3", "gemma3", "qwen2_5_vl")  # the vision families (backends/vision FAMILIES) MLX reads images of


def refusal(folder: Path, family: str) -> str | None:
    """Why MLX cannot serve the vision model in `folder` of `family`, or None when it can."""
    if family not in SERVED:
        return (f"{folder.name} reads images ({family}): the MLX backend reads images of {', '.join(SERVED)} "
                "only; serve it with --backend torch")
    try:
        import torch  # noqa: F401  (the tower's)
    except ImportError:
        return (f"{folder.name} reads images ({family}): its vision tower runs on torch (transformers' modules), "
                "which does not import here: install it (pip install 'kvfork[vision]') or serve it with "
                "--backend torch")
    return None


def load_text_model(folder: Path) -> tuple[nn.Module, Any]:
    """(mlx-lm's model of the folder's text model, holding the checkpoint's text weights; its tokenizer)."""
    from kvfork.backends.torch.loading import text_name
    from kvfork.backends.torch.vision import split_weights

    text_config = mlx_lm_config(json.loads((folder / "config.json").read_text())["text_config"])

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


def mlx_lm_config(text: dict) -> dict:
    """A text_config as mlx-lm's ModelArgs read it: transformers 5 writes Gemma 3's layer pattern as `layer_types`
    and its RoPE bases and scaling in `rope_parameters`, where mlx-lm reads `sliding_window_pattern`, `rope_theta`,
    `rope_local_base_freq` and `rope_scaling`. Qwen2.5-VL's text model is mlx-lm's qwen2, its M-RoPE sections
    left to mrope.py."""
    if text.get("model_type") == "qwen2_5_vl_text":
        theta = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta")
        plain = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")}
        return {**plain, "model_type": "qwen2", **({"rope_theta": theta} if theta else {})}
    if text.get("model_type") != "gemma3_text" or not text.get("layer_types"):
        return text
    rope = text.get("rope_parameters") or {}
    full = rope.get("full_attention", {})
    kinds = text["layer_types"]
    filled = {"sliding_window_pattern": kinds.index("full_attention") + 1 if "full_attention" in kinds else len(kinds),
              "rope_theta": full.get("rope_theta"),
              "rope_local_base_freq": rope.get("sliding_attention", {}).get("rope_theta"),
              "rope_scaling": full if full.get("rope_type", "default") != "default" else None}  # 4B up: linear
    return {**text, **{k: v for k, v in filled.items() if v is not None and text.get(k) is None}}


class Spans:
    """The chunk's images whose tokens attend each other both ways: [start, end) in the chunk, set while it runs."""

    def __init__(self) -> None:
        self.now: tuple[tuple[int, int], ...] = ()


class BothWays(nn.Module):
    """A layer whose mask lets each image of `spans` see all of its own tokens (Gemma 3's image rule, as
    transformers': causal or same image, and in a sliding layer only keys less than its window back), on top of
    mlx-lm's causal (or sliding) mask. The image lies whole in the chunk, so its keys are the chunk's own: the
    last columns of the mask, whatever the cache holds before them."""

    def __init__(self, layer: nn.Module, spans: Spans):
        super().__init__()
        self.layer = layer
        self.spans = spans

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.spans.now:
            n = x.shape[1]
            if not isinstance(mask, mx.array):  # "causal" (or None, one token): every key held so far
                mask = create_causal_mask(n, cache.offset if cache is not None else 0)
            rows = mx.arange(n)[:, None]
            cols = mx.arange(mask.shape[-1])[None] - (mask.shape[-1] - n)
            held = cols >= rows - cache.max_size + 1 if hasattr(cache, "max_size") else True  # a window's keys
            for a, b in self.spans.now:
                mask = mask | ((rows >= a) & (rows < b) & (cols >= a) & (cols < b) & held)
        return self.layer(x, mask, cache)

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        if "layer" in self:
            return getattr(self["layer"], name)  # the block's attention, norms, MLP
        raise AttributeError(name)


class MLXVisionReader:
    """The torch backend's tower and encoder cache, its embeddings handed to the text model as mx arrays."""

    def __init__(self, folder: Path, model: nn.Module, cache_bytes: int):
        """`cache_bytes`: --encoder-cache-bytes (torch/vision.py's VisionReader)."""
        import torch

        from kvfork.backends.torch.loading import read_weights
        from kvfork.backends.torch.vision import VisionReader, split_weights

        _, tower = split_weights(folder, read_weights(folder, torch.device("cpu")), False)
        assert tower is not None, f"{folder} is no vision model"
        self.embed = model.model.embed_tokens  # mlx-lm's text models: an inner `model` with `embed_tokens`
        self.reader = VisionReader(folder, tower, torch.device("cpu"), torch.float32, cache_bytes,
                                   self.embed.weight.shape[-1])
        self.token_bytes = self.reader.token_bytes  # one image token's embedding, held as torch's on the host
        self.dtype = self.embed.weight.dtype
        self.spans = Spans()
        self.scale: float | mx.array = 1.0  # what the text model multiplies its input embeddings by (Gemma's sqrt(hidden))
        if self.reader.processing.bidirectional:
            model.model.layers = [BothWays(layer, self.spans) for layer in model.model.layers]
        if getattr(model, "model_type", None) == "gemma3_text":  # as mlx-lm's Gemma3Model: sqrt(hidden) in bfloat16
            self.scale = mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(self.dtype)
        section = mrope.mrope_section(json.loads((folder / "config.json").read_text())["text_config"])
        self.placement = mrope.wrap(model, section, model.args.rope_theta) if section else None

    def weight_bytes(self) -> int:
        """The tower's weights (torch's, on the host)."""
        return sum(t.nbytes for t in (*self.reader.tower.parameters(), *self.reader.tower.buffers()))

    def encode(self, images: Sequence[ImageInput], scope: str) -> int:
        return self.reader.encode(images, scope)

    def release(self, images: Sequence[int]) -> None:
        self.reader.release(images)

    def check(self, chunks: Sequence[Sequence[int]]) -> None:
        """ValueError where a chunk holds a key of an image no running request holds (`encode`)."""
        self.reader.check(chunks)

    @contextmanager
    def reading(self, chunk: Sequence[int], start: int,
                shifts: RopeShifts) -> Iterator[tuple[mx.array, mx.array | None, RopeShifts]]:
        """While a chunk written from position `start` runs (it was `check`ed) on a session of M-RoPE `shifts`: its
        ids [1, n] (keys as the image placeholder), where it holds image keys its input embeddings [1, n, hidden]
        (the tokens' own, the images' rows at their keys), and the session's shifts after it; the layers see its
        images both ways where the family's do, and turn its tokens by their M-RoPE positions where it has them."""
        ids, placed = self.reader.place(chunk, start) if any(t >= IMAGE_KEY_BASE for t in chunk) else (list(chunk), [])
        tokens = mx.array(ids)[None]
        if self.placement is not None:
            from kvfork.backends.torch.images import mrope_positions

            positions, shifts = mrope_positions(start, len(chunk), shifts, placed)
            self.placement.chunk = (start, mx.array(positions.numpy()).astype(mx.float32))
        try:
            yield tokens, self._embedded(tokens, start, placed) if placed else None, shifts
        finally:
            self.spans.now = ()
            if self.placement is not None:
                self.placement.chunk = None

    def _embedded(self, tokens: mx.array, start: int, placed: Sequence[Any]) -> mx.array:
        """The chunk's input embeddings [1, n, hidden]: its images' rows over the slots they hold in it (an image
        placed by M-RoPE may begin in an earlier chunk); sets the spans seen both ways where the family's are."""
        n = tokens.shape[1]
        rows = np.zeros((n, self.embed.weight.shape[-1]), np.float32)
        seen = np.zeros((n, 1), bool)
        spans = []
        for image in placed:  # a run of keys (grid None), or a whole image from its first key (place)
            lo, hi = max(image.start, start), min(image.end, start + n)
            rows[lo - start:hi - start] = image.embeddings[lo - image.start:hi - image.start].float().numpy()
            seen[lo - start:hi - start] = True
            spans.append((lo - start, hi - start))
        image_rows = mx.array(rows).astype(self.dtype) / self.scale
        self.spans.now = tuple(spans) if self.reader.processing.bidirectional else ()
        return mx.where(mx.array(seen), image_rows, self.embed(tokens)[0])[None]

    @contextmanager
    def decoding(self, rows: Sequence[tuple[RopeShifts, int]]) -> Iterator[None]:
        """While a decode batch's step runs, its rows' (M-RoPE shifts, position) in row order: each row turned
        at its cache's offset plus its shift."""
        if self.placement is None:
            yield
            return
        self.placement.shift = mx.array([shift_at(shifts, position) for shifts, position in rows])
        try:
            yield
        finally:
            self.placement.shift = 0
