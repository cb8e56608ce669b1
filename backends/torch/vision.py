"""Reading images on torch: a vision family's tower (transformers' modules, the checkpoint's weights), the
encoder cache, and a chunk's image keys turned into the embeddings the text model reads (images.py).

The tower runs on the runner thread, at a request's start, for the images whose keys lie past what it
reused (Backend.encode_images): an image already in the reused state is never encoded. Its output is kept
by (scope, image), least recently used first, within --encoder-cache-bytes (reserved out of the KV budget,
server/engine/policy/memory_plan.py), so a screenshot an agent resends next turn is not encoded again; another
tenant's encoding is never reused (its timing would tell one tenant what another sent). The images of
running requests are pinned until they end, counted in their requests' KV reservations
(ModelInfo.image_token_bytes a token).
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from kvfork.backends.torch import images, vision_towers
from kvfork.backends.torch.config import ArchConfig
from kvfork.backends.torch.images import PlacedImage
from kvfork.backends.vision import ImageInput, folder_family, load_processing, vision_family
from kvfork.backends.vision.keys import IMAGE_KEY_BASE, image_of, index_of

Encoded = tuple[torch.Tensor, tuple[int, int, int] | None]  # an image's embeddings, and its tokens' grid
# each family's tower weights (transformers 5's names; the hub's older ones without `model.`), by family module
TOWER_PREFIXES = {"idefics3": ("model.vision_model.", "model.connector."),
                  "qwen2_5_vl": ("model.visual.", "visual."),
                  "gemma3": ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                             "multi_modal_projector.")}
TEXT_PREFIX = "model.text_model."


class Idefics3Tower(nn.Module):
    """SigLIP's encoder over each tile, then the connector: a pixel shuffle and a projection to the text
    model's width (transformers' Idefics3 modules)."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers import Idefics3Config
        from transformers.models.idefics3.modeling_idefics3 import Idefics3Connector, Idefics3VisionTransformer

        cfg = Idefics3Config(**config)
        self.vision_model = Idefics3VisionTransformer(cfg.vision_config)
        self.connector = Idefics3Connector(cfg)
        self.patch = cfg.vision_config.patch_size

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """One image's tiles [tiles, 3, H, W] and their mask [tiles, H, W] -> [tokens, text hidden]."""
        p = self.patch
        patches = pixel_attention_mask.bool().unfold(1, p, p).unfold(2, p, p)
        seen = patches.sum(dim=(-1, -2)) > 0  # a patch holding any real pixel
        hidden = self.vision_model(pixel_values=pixel_values, patch_attention_mask=seen).last_hidden_state
        out = self.connector(hidden)
        return out.reshape(-1, out.shape[-1])

    def encode(self, arrays: dict) -> tuple[torch.Tensor, None]:
        """The processor's arrays -> the image's embeddings; its tokens lie as text does (no grid)."""
        param = next(self.parameters())
        pixels = torch.from_numpy(arrays["pixel_values"]).to(param.device, param.dtype)
        return self(pixels, torch.from_numpy(arrays["pixel_attention_mask"]).to(param.device)), None


TOWERS: dict[str, type[nn.Module]] = {"idefics3": Idefics3Tower, **vision_towers.TOWERS}


def split_weights(folder: Path, weights: dict[str, torch.Tensor],
                  split: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """A checkpoint's (text model's, tower's) weights, the text model's under the names a text checkpoint
    gives them; no tower for a text model. `split`: over tensor-parallel ranks, which a tower is not."""
    family = folder_family(folder)
    if family is None:
        return weights, None
    if split:
        raise ValueError("torch backend: a model that reads images is served on one device")
    text, tower = {}, {}
    prefixes = TOWER_PREFIXES[family]
    for name, w in weights.items():
        if name.startswith(prefixes):
            tower[name.removeprefix("model.")] = w
        else:
            text[("model." + name.removeprefix(TEXT_PREFIX)) if name.startswith(TEXT_PREFIX) else name] = w
    return text, tower


class VisionReader:
    """A model's tower, its processing (pixels from a picture), and the encoder cache."""

    def __init__(self, folder: Path, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                 cache_bytes: int, hidden_size: int):
        """`cache_bytes`: the most embeddings kept for images sent again (0: none); `hidden_size`: the text
        model's, each image token's embedding width."""
        from transformers import AutoTokenizer

        config = json.loads((folder / "config.json").read_text())
        family = vision_family(config)
        assert family is not None, f"{folder} is no vision model"
        self.processing = load_processing(folder, AutoTokenizer.from_pretrained(str(folder)))
        self.tower: Any = TOWERS[family](config)  # its family's: encode(arrays) -> (embeddings, grid)
        self.tower.load_state_dict(weights, strict=True)
        self.tower.to(device, dtype).eval()
        self.device, self.dtype, self.cache_bytes = device, dtype, cache_bytes
        self.token_bytes = hidden_size * dtype.itemsize  # one image token's embedding
        self.image_token_id = self.processing.image_token_id
        # (embeddings, grid of their tokens or None), least recently used first
        self._kept: OrderedDict[tuple[str, int], Encoded] = OrderedDict()
        self._pins: Counter[int] = Counter()
        self._live: dict[int, Encoded] = {}  # pinned images' encodings, by image id
        self.encoded = 0  # images the tower ran for, since loading

    def encode(self, images: Sequence[ImageInput], scope: str) -> int:
        """Pin each image's embeddings, encoding those the cache does not hold for `scope`; how many it encoded."""
        ran = 0
        for image in images:
            encoded = self._kept.get((scope, image.image))
            if encoded is None:
                encoded = self._encode(image)
                ran += 1
                self._keep((scope, image.image), encoded)
            else:
                self._kept.move_to_end((scope, image.image))
            self._pins[image.image] += 1
            self._live[image.image] = encoded
        self.encoded += ran
        return ran

    @torch.inference_mode()
    def _encode(self, image: ImageInput) -> Encoded:
        embeddings, grid = self.tower.encode(self.processing.pixels(image.load()))
        if embeddings.shape[0] != image.tokens:
            raise ValueError(f"the image's encoding holds {embeddings.shape[0]} tokens, its prompt {image.tokens}")
        return embeddings, grid

    def _keep(self, key: tuple[str, int], encoded: Encoded) -> None:
        self._kept[key] = encoded
        while self._kept and self.cached_bytes() > self.cache_bytes:
            self._kept.popitem(last=False)

    def cached_bytes(self) -> int:
        return sum(embeddings.nbytes for embeddings, _ in self._kept.values())

    def release(self, images: Sequence[int]) -> None:
        for image in images:
            self._pins[image] -= 1
            if self._pins[image] <= 0:
                del self._pins[image]
                self._live.pop(image, None)

    def check(self, chunks: Sequence[Sequence[int]]) -> None:
        """Raise ValueError where a chunk holds a key of an image no running request pinned."""
        for chunk in chunks:
            for t in chunk:
                if t >= IMAGE_KEY_BASE and image_of(t) not in self._live:
                    raise ValueError("a chunk holds an image that was not encoded (Backend.encode_images)")

    def read(self, chunks: Sequence[Sequence[int]], starts: Sequence[int],
             cfg: ArchConfig) -> tuple[Sequence[Sequence[int]], Sequence[Sequence[PlacedImage]]]:
        """A pass's chunks (row i written from slot starts[i]) with their keys as the placeholder id, and each
        row's images (`place`); ValueError where an image was not encoded or the model cannot read a row's."""
        self.check(chunks)
        chunks, placed = zip(*(self.place(chunk, start) for chunk, start in zip(chunks, starts)))
        images.check_rows(cfg, starts, chunks, placed)
        return chunks, placed

    def place(self, chunk: Sequence[int], start: int) -> tuple[list[int], list[PlacedImage]]:
        """The chunk (written from slot `start`) with its keys as the placeholder id, and its images' embeddings
        over the slots they take: one PlacedImage a run of one image's keys (Idefics3 lays text between its
        tiles), each run's rows from its first key's index on; an image with a grid (its keys in one run:
        Qwen2.5-VL, Gemma 3) whole, from its first key's slot, as M-RoPE places it by its start."""
        ids, placed, run = [], [], None  # run: (image, slot of its first key, index of its first key, length)
        for j, t in enumerate(chunk):
            if run is not None and not (t == run[4] + run[3]):  # the run ends here
                placed.append(self._placed(*run[:4]))
                run = None
            if t < IMAGE_KEY_BASE:
                ids.append(t)
                continue
            ids.append(self.image_token_id)
            run = (image_of(t), start + j, index_of(t), 1, t) if run is None else (*run[:3], run[3] + 1, run[4])
        if run is not None:
            placed.append(self._placed(*run[:4]))
        return ids, placed

    def _placed(self, image: int, slot: int, index: int, length: int) -> PlacedImage:
        embeddings, grid = self._live[image]
        if grid is not None:
            return PlacedImage(slot - index, embeddings, grid)
        return PlacedImage(slot, embeddings[index:index + length])
