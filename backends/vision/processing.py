"""What a vision family does on the server's side: an image as prompt text, and as pixel arrays.

A family's `ImageProcessing` holds transformers' image processor for the model (its PIL path: no torchvision)
and the tokenizer's ids. The prompt's text for an image depends on its size alone, so a prompt is
tokenized without touching a pixel; the pixel arrays are made on the runner thread, only for an image
the encoder has not seen (Backend.encode_images).
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Any

import numpy as np


class ImageProcessing(abc.ABC):
    image_token_id: int  # the placeholder whose positions take the image's embeddings (keys.py)
    bidirectional: bool = False  # an image's tokens attend each other both ways: one prefill chunk holds it

    def __init__(self, folder: Path, tokenizer: Any = None):
        """The model's config.json and transformers' image processor from its folder; a family whose prompt
        text needs the tokenizer or another processor class builds its own."""
        from transformers import AutoImageProcessor

        self.config = json.loads((folder / "config.json").read_text())
        self.images = AutoImageProcessor.from_pretrained(str(folder))
        self.image_token_id = self.config.get("image_token_index", self.config.get("image_token_id"))

    @abc.abstractmethod
    def prompt_text(self, width: int, height: int) -> str:
        """The text one image of this size stands as in the rendered prompt."""

    @abc.abstractmethod
    def pixels(self, picture: Any) -> dict[str, np.ndarray]:
        """The vision tower's inputs for one PIL RGB picture."""
