"""Images in the text model: where an image's embeddings replace its placeholder tokens, the M-RoPE
positions of its tokens and of the text after it, and which of its tokens see each other.

An image stands in a session as `tokens` consecutive slots holding placeholder ids; the vision tower's
embeddings replace those tokens' embeddings after the token embedding (and after gemma's scale), as
transformers' `masked_scatter` does (`scatter`), so everything from the first layer on reads them as tokens.

M-RoPE (Qwen2.5-VL's multimodal rotary positions): every token has three positions, temporal, height
and width, and the rotary frequencies come in three sections, each turned by one of them. A text token's
three are equal; an image's token at row i, column j of its (t, h, w) grid has (b + t, b + i, b + j),
b being where the image starts; the text after it continues from b + max(h, w), not from its slot: a
session keeps its `rope_shifts` (backends/vision/positions.py), and decode rows need nothing else.

Gemma 3 lets an image's tokens attend each other both ways (causal elsewhere, and within a sliding
layer's window): its mask is the layer's, or'ed with "same image". A row must then hold the image
whole: a query before the image's last token sees keys that only a later chunk would write, so a chunk
ending inside such an image is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvfork.backends.torch.config import ArchConfig, HybridConfig
from kvfork.backends.vision.positions import RopeShifts, shift_at



@dataclass(frozen=True)
class PlacedImage:
    """One image's tokens in a session: slots [start, start + tokens), `embeddings` [tokens, hidden] in the
    text model's dtype, the projector's output; `grid` (t, h, w), t * h * w == tokens, its tokens' layout,
    which M-RoPE places them by (None: a family that places them as text)."""

    start: int  # the slot of its first token (it may begin before the chunk that reads it)
    embeddings: torch.Tensor
    grid: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.grid is not None and self.grid[0] * self.grid[1] * self.grid[2] != self.tokens:
            raise ValueError(f"an image of {self.tokens} tokens cannot have the grid {self.grid}")

    @property
    def tokens(self) -> int:
        return self.embeddings.shape[0]

    @property
    def end(self) -> int:
        return self.start + self.tokens


def overlapping(images: Sequence[PlacedImage], start: int, end: int) -> list[PlacedImage]:
    """The images with a token in [start, end), in slot order."""
    return sorted((image for image in images if image.start < end and image.end > start), key=lambda i: i.start)


def check_rows(cfg: ArchConfig | HybridConfig, starts: Sequence[int], chunks: Sequence[Sequence[int]],
               placed: Sequence[Sequence[PlacedImage]]) -> None:
    """Refuse rows whose images the model cannot read: on a hybrid, of another width
    than its hidden size, or cut by the chunk where its tokens attend each other both ways."""
    for start, chunk, row in zip(starts, chunks, placed):
        if row and isinstance(cfg, HybridConfig):
            raise ValueError(f"a {cfg.family} model reads no images")
        if any(image.embeddings.shape[-1] != cfg.hidden_size for image in row):
            raise ValueError(f"an image's embeddings are not {cfg.hidden_size} wide")
        end = start + len(chunk)
        for image in row if isinstance(cfg, ArchConfig) and cfg.bidirectional_images else ():
            if image.start < start < image.end or image.start < end < image.end:
                raise ValueError(f"a prefill chunk [{start}, {end}) cuts the image at [{image.start}, {image.end}): "
                                 "its tokens attend each other both ways, so one chunk holds all of them")


def mrope_positions(start: int, length: int, shifts: RopeShifts,
                    images: Sequence[PlacedImage]) -> tuple[torch.Tensor, RopeShifts]:
    """The three positions [3, length] of slots [start, start + length), and the shifts with those of the
    images that end inside it added."""
    shift = shift_at(shifts, start)
    out = (torch.arange(start, start + length) + shift)[None].repeat(3, 1)
    added = []
    for image in overlapping(images, start, start + length):
        if image.grid is None:
            raise ValueError("M-RoPE places an image by its grid, and this one has none")
        _, h, w = image.grid
        first, last = max(image.start, start), min(image.end, start + length)
        k = torch.arange(first - image.start, last - image.start)
        base = image.start + shift  # the image's first position: the shift is the one in force before it
        out[:, first - start:last - start] = torch.stack((k * 0, k // w % h, k % w)) + base
        out[0, first - start:last - start] += k // (h * w)
        if image.end <= start + length:
            shift += max(h, w) - image.tokens
            out[:, image.end - start:] += max(h, w) - image.tokens
            added.append((image.end, shift))
    return out, shifts + tuple(added)


def positions(rows: Sequence, shifts: Sequence[RopeShifts], images: Sequence[Sequence[PlacedImage]],
              cfg: ArchConfig | HybridConfig, device) -> tuple[torch.Tensor, list[RopeShifts]]:
    """The positions of a pass's rows (model.VarlenRow) end to end, [tokens] (M-RoPE: [3, tokens]), and each row's
    shifts after it; `images[i]`: row i's."""
    if not (isinstance(cfg, ArchConfig) and cfg.mrope_section):
        return torch.tensor([row.start + j for row in rows for j in range(row.length)], device=device), list(shifts)
    each = [mrope_positions(row.start, row.length, shift, placed) for row, shift, placed in zip(rows, shifts, images)]
    return torch.cat([p for p, _ in each], dim=1).to(device), [after for _, after in each]


def mrope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, section: Sequence[int],
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [3, tokens]: frequency d turned by the position of its section (temporal,
    height, width, in turn), shaped as rope.angles' [1, tokens, 1, head_dim/2]."""
    which = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(section)).to(positions.device)
    theta = positions.to(torch.float32)[which, :].T * inv_freq  # [tokens, head_dim/2]
    theta = theta[None, :, None, :]
    return theta.cos() * scale, theta.sin() * scale


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


def image_mask(images: Sequence[PlacedImage], start: int, n: int, first_key: int, n_keys: int, window: int | None,
               device) -> torch.Tensor:
    """Boolean [n, n_keys]: query start+i sees key first_key+j when the key is not after it or both are one
    image's, and, in a sliding layer, within its past `window` positions."""
    q = torch.arange(start, start + n, device=device)[:, None]
    k = torch.arange(first_key, first_key + n_keys, device=device)[None, :]
    seen = k <= q
    for image in images:
        seen |= (q >= image.start) & (q < image.end) & (k >= image.start) & (k < image.end)
    return seen if window is None else seen & (k > q - window)
