"""Models that read images: which families, and what a request's image is on its way to a backend.

A vision model's folder is a hub folder whose config.json names a vision family (`FAMILIES`): its text
model is one kvfork's backends serve (its `text_config`), beside a vision tower and the image processor's
files. The server expands each image of a prompt into the family's tokens (`ImageProcessing`, processing.py),
whose embedding positions are image keys (keys.py); the backend encodes the image's pixels on the runner
thread, once per tenant while its encoder cache holds it (Backend.encode_images), and reads the keys'
rows from there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

# config.json's model_type -> the family's module in this package (SmolVLM-256M, -500M and -Instruct are idefics3;
# SmolVLM2's `smolvlm` is the same architecture, transformers' SmolVLM modules subclassing Idefics3's)
FAMILIES = {"idefics3": "idefics3", "smolvlm": "idefics3", "qwen2_5_vl": "qwen2_5_vl", "gemma3": "gemma3"}


@dataclass(frozen=True)
class ImageInput:
    """One image of a request's prompt, as the runner hands it to the backend."""

    image: int  # its id in the keys (keys.image_id of the server's pixel hash)
    start: int  # the prompt offset of its first key
    end: int  # past its last key (a family may lay text tokens between its keys: Idefics3's tiles)
    tokens: int  # how many keys it takes: the rows of its embeddings
    load: Callable[[], Any] = lambda: None  # the decoded picture (PIL, RGB): called only when it must be encoded
    whole: bool = False  # its tokens attend each other both ways (ImageProcessing.bidirectional): one chunk holds it


class ImageReader(Protocol):
    """A loaded model's tower and encoder cache, as a backend holds it (Backend.vision)."""

    def encode(self, images: Sequence[ImageInput], scope: str) -> int:
        """Hold each image's embeddings until `release`, encoding those `scope`'s cache lacks; how many it encoded."""

    def release(self, images: Sequence[int]) -> None:
        """The request these images (their ids) were held for ended."""


def vision_family(config: dict) -> str | None:
    """The vision family a config.json names (its module here), or None for a text model."""
    return FAMILIES.get(config.get("model_type", ""))


def folder_family(folder: str | Path) -> str | None:
    """The vision family a model folder's config names; None for a text model, or without a readable config
    (its load says what is wrong)."""
    path = Path(folder) / "config.json"
    try:
        return vision_family(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def load_processing(folder: str | Path, tokenizer: Any):
    """The family's ImageProcessing for a model folder and its loaded tokenizer; None for a text model."""
    family = folder_family(folder)
    if family is None:
        return None
    from importlib import import_module

    return import_module(f"kvfork.backends.vision.{family}").load(Path(folder), tokenizer)
