"""The image side of a vision-language model whose text model is ours (model.py): transformers' image
processor, vision tower and projector, read from the model folder in the hub layout.

    prepare(image)  a decoded picture -> its pixel values, and the tokens it takes in the prompt (any thread)
    prompt(pixels)  the text that stands for it where the chat template put the family's marker
    encode(pixels)  -> the embeddings [tokens, text hidden] that replace those tokens' (images.py), on the
                    runner's device

Families (config.json's model_type):
- qwen2_5_vl: the Qwen2-VL image processor (PIL; `AutoProcessor` does not build without torchvision, so
  the image processor stands alone), transformers' Qwen2.5-VL vision transformer with its patch merger. An
  image of h x w patches takes (h / merge) x (w / merge) tokens, `<|image_pad|>` each, between the
  template's `<|vision_start|>` and `<|vision_end|>`; their grid gives the text model its M-RoPE positions.
- gemma3: the Gemma 3 image processor (one square picture, no pan and scan), transformers' SigLIP vision
  model and Gemma 3's projector (pooled to `mm_tokens_per_image`). The template's `<start_of_image>` becomes
  `\\n\\n<start_of_image>`, the image's tokens and `<end_of_image>\\n\\n`, as Gemma 3's processor writes it; the
  image's tokens attend each other both ways (config.bidirectional_images).

transformers is imported when a tower is built, not before (a text model never needs it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

FAMILIES = ("qwen2_5_vl", "gemma3")
# checkpoint prefixes of each family's image side: transformers 5's layout, then the hub's older one
TOWER_PREFIXES = {
    "qwen2_5_vl": {"visual": ("model.visual.", "visual.")},
    "gemma3": {"vision_tower": ("model.vision_tower.", "vision_tower."),
               "multi_modal_projector": ("model.multi_modal_projector.", "multi_modal_projector.")},
}


@dataclass(frozen=True)
class ImagePixels:
    """One image as its tower reads it: `values` (the processor's pixel values) and `grid` (t, h, w) of
    the tokens it becomes, t * h * w of them."""

    values: torch.Tensor
    grid: tuple[int, int, int]

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)


def is_vision_model(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    return config.exists() and json.loads(config.read_text()).get("model_type") in FAMILIES


class VisionTower:
    """A model folder's image side (its family's: `FAMILIES`), on `device` in `dtype`."""

    def __init__(self, folder: str | Path, device: torch.device, dtype: torch.dtype):
        from transformers import AutoConfig, AutoImageProcessor

        folder = Path(folder)
        self.config = AutoConfig.from_pretrained(folder)
        self.family = self.config.model_type
        if self.family not in FAMILIES:
            raise ValueError(f"{folder.name}: model_type {self.family!r} is not a vision family ({FAMILIES})")
        self.processor = AutoImageProcessor.from_pretrained(folder)
        self.device, self.dtype = device, dtype
        self.modules = self._build()
        weights = _read_prefixed(folder, TOWER_PREFIXES[self.family])
        for name, module in self.modules.items():
            module.load_state_dict(weights[name], strict=True)
            module.to(device, dtype).eval()

    # -- the prompt ------------------------------------------------------

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def marker(self) -> str:
        """What the chat template writes where an image goes."""
        return "<|image_pad|>" if self.family == "qwen2_5_vl" else "<start_of_image>"

    def prompt(self, pixels: ImagePixels) -> str:
        """The text the marker becomes for this image: its tokens, with the family's wrapping."""
        if self.family == "qwen2_5_vl":
            return "<|image_pad|>" * pixels.tokens
        return f"\n\n<start_of_image>{'<image_soft_token>' * pixels.tokens}<end_of_image>\n\n"

    # -- pixels to embeddings --------------------------------------------

    def prepare(self, image) -> ImagePixels:
        """A PIL image as the family's processor makes it (resized, normalised, cut in patches)."""
        batch = self.processor(images=[image.convert("RGB")], return_tensors="pt")
        if self.family == "qwen2_5_vl":
            merge = self.config.vision_config.spatial_merge_size
            t, h, w = (int(n) for n in batch["image_grid_thw"][0])
            return ImagePixels(batch["pixel_values"], (t, h // merge, w // merge))
        side = math.isqrt(self.config.mm_tokens_per_image)
        return ImagePixels(batch["pixel_values"], (1, side, side))

    @torch.inference_mode()
    def encode(self, pixels: ImagePixels) -> torch.Tensor:
        """The image's embeddings [tokens, text hidden], in the text model's input space."""
        values = pixels.values.to(self.device, self.dtype)
        if self.family == "qwen2_5_vl":
            t, h, w = pixels.grid
            merge = self.config.vision_config.spatial_merge_size
            grid = torch.tensor([[t, h * merge, w * merge]], device=self.device)
            out = self.modules["visual"](values, grid_thw=grid).pooler_output
        else:
            hidden = self.modules["vision_tower"](pixel_values=values).last_hidden_state
            out = self.modules["multi_modal_projector"](hidden)[0]
        if out.shape[0] != pixels.tokens:
            raise ValueError(f"the vision tower made {out.shape[0]} embeddings for an image of {pixels.tokens} tokens")
        return out

    def _build(self) -> dict[str, torch.nn.Module]:
        """The family's modules, built as transformers builds them (their buffers, such as rotary
        frequencies, are made at construction, not read), the weights read into them after."""
        from transformers import AutoModel

        if self.family == "qwen2_5_vl":
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

            return {"visual": Qwen2_5_VisionTransformerPretrainedModel(self.config.vision_config)}
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        return {"vision_tower": AutoModel.from_config(self.config.vision_config),
                "multi_modal_projector": Gemma3MultiModalProjector(self.config)}


def _read_prefixed(folder: Path, prefixes: dict[str, tuple[str, ...]]) -> dict[str, dict[str, torch.Tensor]]:
    """The folder's weights under each module's prefixes, by the module's own names."""
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in prefixes}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                for name, starts in prefixes.items():
                    start = next((p for p in starts if key.startswith(p)), None)
                    if start is not None:
                        out[name][key[len(start):]] = f.get_tensor(key)
    return out
