"""An image's embeddings placed in a session's slots: what the text model reads in place of the token
embeddings of an image's positions (as transformers' masked_scatter does, after gemma's embedding scale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PlacedImage:
    start: int  # the slot of its first token (it may begin before the chunk that reads it)
    embeddings: torch.Tensor  # [tokens, hidden], the text model's dtype: the projector's output
    grid: tuple[int, int, int] | None = None  # (t, h, w) of its tokens, for families that place them in 3-D

    @property
    def end(self) -> int:
        return self.start + self.embeddings.shape[0]


def scatter(h: torch.Tensor, starts: Sequence[int], lengths: Sequence[int],
            images: Sequence[Sequence[PlacedImage]]) -> torch.Tensor:
    """h [tokens, hidden], rows end to end (row i: `lengths[i]` slots from `starts[i]`), with each row's
    images' embeddings written over the slots they hold inside it."""
    at = 0
    for start, length, placed in zip(starts, lengths, images):
        for image in placed:
            lo, hi = max(start, image.start), min(start + length, image.end)
            if lo < hi:
                h[at + lo - start:at + hi - start] = image.embeddings[lo - image.start:hi - image.start].to(h.dtype)
        at += length
    return h
