"""Gemma 3: one square picture (no pan and scan), `mm_tokens_per_image` tokens written as its processor
writes them, `\\n\\n<start_of_image>`, the tokens, `<end_of_image>\\n\\n`; they attend each other both ways
(`bidirectional`: a chunk and a reuse point never cut one).

The image processor is transformers' own (its PIL path: no torchvision); `AutoProcessor` is not used.
The prompt's text for an image comes from its size alone; the pixel arrays feed
backends/torch/vision_towers.py's `Gemma3Tower`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kvfork.backends.vision.processing import ImageProcessing


class Gemma3Processing(ImageProcessing):
    bidirectional = True

    def tokens(self, width: int, height: int) -> int:
        return self.config.get("mm_tokens_per_image", 256)

    def prompt_text(self, width: int, height: int) -> str:
        return f"\n\n<start_of_image>{'<image_soft_token>' * self.tokens(width, height)}<end_of_image>\n\n"

    def pixels(self, picture: Any) -> dict[str, np.ndarray]:
        return {"pixel_values": self.images(images=[picture], return_tensors="np")["pixel_values"]}


def load(folder: Path, tokenizer: Any) -> Gemma3Processing:
    return Gemma3Processing(folder, tokenizer)
