"""Idefics3 and SmolVLM (whose text model is llama): an image split into tiles of the encoder's size, each
tile `image_seq_len` tokens after the connector's pixel shuffle, and the whole image once more, downsized.

The layout of an image's text is transformers' Idefics3Processor's; the tiles are its image processor's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvfork.backends.vision.processing import ImageProcessing


def image_seq_len(config: dict) -> int:
    """Tokens a tile takes: the encoder's patches, folded scale_factor**2 at a time by the connector."""
    vision = config["vision_config"]
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    return int(patches / config.get("scale_factor", 2) ** 2)


class Idefics3Processing(ImageProcessing):
    def __init__(self, folder: Path, tokenizer: Any):
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        config = json.loads((folder / "config.json").read_text())
        self.images = Idefics3ImageProcessorPil.from_pretrained(str(folder))
        self._layout = Idefics3Processor(self.images, tokenizer, image_seq_len=image_seq_len(config))
        self.image_token_id = config.get("image_token_id", self._layout.image_token_id)

    def prompt_text(self, width: int, height: int) -> str:
        _, rows, cols = self.images.get_number_of_image_patches(height, width, {})
        return self._layout.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)

    def pixels(self, picture: Any) -> dict[str, np.ndarray]:
        out = self.images(images=[[picture]], return_tensors="np")
        return {"pixel_values": out["pixel_values"][0], "pixel_attention_mask": out["pixel_attention_mask"][0]}


def load(folder: Path, tokenizer: Any) -> Idefics3Processing:
    return Idefics3Processing(folder, tokenizer)
