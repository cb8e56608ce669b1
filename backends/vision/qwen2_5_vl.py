"""Qwen2.5-VL: an image resized to whole merged patches within the processor's pixel bounds, (h / merge) x
(w / merge) `<|image_pad|>` tokens between `<|vision_start|>` and `<|vision_end|>`, as its chat template writes
an image; their grid gives the text model its M-RoPE positions (backends/torch/images.py).

The image processor is transformers' own (its PIL path: no torchvision); `AutoProcessor` is not used (it does not build
without torchvision).
The prompt's text for an image comes from its size alone; the pixel arrays feed
backends/torch/vision_towers.py's `Qwen2_5_VLTower`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvfork.backends.vision.processing import ImageProcessing


class Qwen2_5_VLProcessing(ImageProcessing):
    bidirectional = False

    def tokens(self, width: int, height: int) -> int:
        """The image's tokens: its patches after the processor's resize, merged merge x merge."""
        merge = self.config["vision_config"].get("spatial_merge_size", 2)
        return self.images.get_number_of_image_patches(height, width, {}) // merge**2

    def prompt_text(self, width: int, height: int) -> str:
        return f"<|vision_start|>{'<|image_pad|>' * self.tokens(width, height)}<|vision_end|>"

    def pixels(self, picture: Any) -> dict[str, np.ndarray]:
        out = self.images(images=[picture], return_tensors="np")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def load(folder: Path, tokenizer: Any) -> Qwen2_5_VLProcessing:
    return Qwen2_5_VLProcessing(folder, tokenizer)
