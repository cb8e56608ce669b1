"""The image side of the vision-language models whose text model is ours with images (images.py): Qwen2.5-VL
and Gemma 3, each as transformers' image processor (its PIL path: no torchvision) and transformers' vision
modules, read from the model folder in the hub layout.

A family's `Processing` works on the server's side: the text one image stands as in the prompt, from its
size alone (`prompt_text`, so a prompt is tokenized without touching a pixel), and the tower's inputs for
a decoded picture (`pixels`). Its `Tower` is the torch module: `encode(arrays)` -> the embeddings that
replace the image's tokens' [tokens, text hidden], and the (t, h, w) grid of those tokens.

- qwen2_5_vl: the Qwen2-VL image processor resizes to whole merged patches within its pixel bounds; an
  image of h x w patches takes (h / merge) x (w / merge) `<|image_pad|>` tokens, between
  `<|vision_start|>` and `<|vision_end|>` (as Qwen2.5-VL's chat template writes an image), and the grid gives
  the text model their M-RoPE positions. The tower is Qwen2.5-VL's vision transformer with its patch merger.
- gemma3: one square picture (no pan and scan) through SigLIP, pooled by Gemma 3's projector to
  `mm_tokens_per_image` tokens, written as Gemma 3's processor writes them:
  `\\n\\n<start_of_image>`, the image's tokens, `<end_of_image>\\n\\n`; they attend each other both ways
  (`bidirectional`: a chunk and a reuse point never cut one).

transformers is imported when one is built, never before (a text model never needs it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

Grid = tuple[int, int, int]


class Qwen2_5_VLProcessing:
    bidirectional = False

    def __init__(self, folder: Path, tokenizer: Any = None):
        from transformers import AutoImageProcessor

        config = json.loads((folder / "config.json").read_text())
        self.images = AutoImageProcessor.from_pretrained(str(folder))
        self.image_token_id = config["image_token_id"]
        self.merge = config["vision_config"].get("spatial_merge_size", 2)

    def tokens(self, width: int, height: int) -> int:
        """The image's tokens: its patches after the processor's resize, merged merge x merge."""
        return self.images.get_number_of_image_patches(height, width, {}) // self.merge**2

    def prompt_text(self, width: int, height: int) -> str:
        return f"<|vision_start|>{'<|image_pad|>' * self.tokens(width, height)}<|vision_end|>"

    def pixels(self, picture: Any) -> dict[str, np.ndarray]:
        out = self.images(images=[picture], return_tensors="np")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


class Gemma3Processing:
    bidirectional = True

    def __init__(self, folder: Path, tokenizer: Any = None):
        from transformers import AutoImageProcessor

        config = json.loads((folder / "config.json").read_text())
        self.images = AutoImageProcessor.from_pretrained(str(folder))
        self.image_token_id = config.get("image_token_index", config.get("image_token_id"))
        self.per_image = config.get("mm_tokens_per_image", 256)

    def tokens(self, width: int, height: int) -> int:
        return self.per_image

    def prompt_text(self, width: int, height: int) -> str:
        return f"\n\n<start_of_image>{'<image_soft_token>' * self.per_image}<end_of_image>\n\n"

    def pixels(self, picture: Any) -> dict[str, np.ndarray]:
        return {"pixel_values": self.images(images=[picture], return_tensors="np")["pixel_values"]}


class Qwen2_5_VLTower(nn.Module):
    """Qwen2.5-VL's vision transformer and patch merger (transformers' module), as `visual`."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        self.visual = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLConfig(**config).vision_config)
        self.merge = self.visual.spatial_merge_size

    @torch.inference_mode()
    def encode(self, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, Grid]:
        param = next(self.parameters())
        grid = torch.from_numpy(arrays["image_grid_thw"]).to(param.device)
        out = self.visual(torch.from_numpy(arrays["pixel_values"]).to(param.device, param.dtype), grid_thw=grid)
        t, h, w = (int(n) for n in arrays["image_grid_thw"][0])
        return out.pooler_output, (t, h // self.merge, w // self.merge)


class Gemma3Tower(nn.Module):
    """SigLIP (transformers' vision model) and Gemma 3's projector, as `vision_tower`, `multi_modal_projector`."""

    def __init__(self, config: dict):
        super().__init__()
        from transformers import AutoModel, Gemma3Config
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        cfg = Gemma3Config(**config)
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)
        self.side = math.isqrt(cfg.mm_tokens_per_image)

    @torch.inference_mode()
    def encode(self, arrays: dict[str, np.ndarray]) -> tuple[torch.Tensor, Grid]:
        param = next(self.parameters())
        values = torch.from_numpy(arrays["pixel_values"]).to(param.device, param.dtype)
        out = self.multi_modal_projector(self.vision_tower(pixel_values=values).last_hidden_state)
        return out.reshape(-1, out.shape[-1]), (out.shape[0], self.side, self.side)


PROCESSINGS = {"qwen2_5_vl": Qwen2_5_VLProcessing, "gemma3": Gemma3Processing}
TOWERS: dict[str, type[nn.Module]] = {"qwen2_5_vl": Qwen2_5_VLTower, "gemma3": Gemma3Tower}
# each family's tower weights: transformers 5's names, then the hub's older ones (both read into the Tower)
TOWER_PREFIXES = {"qwen2_5_vl": (("model.visual.", "visual."), ("visual.", "visual.")),
                  "gemma3": (("model.vision_tower.", "vision_tower."), ("vision_tower.", "vision_tower."),
                             ("model.multi_modal_projector.", "multi_modal_projector."),
                             ("multi_modal_projector.", "multi_modal_projector."))}


def read_tower(folder: str | Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A model folder's tower, its weights read from the folder's safetensors, on `device` in `dtype`."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    family = config.get("model_type")
    if family not in TOWERS:
        raise ValueError(f"{folder.name}: model_type {family!r} is not one of {tuple(TOWERS)}")
    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                found = next(((old, new) for old, new in TOWER_PREFIXES[family] if key.startswith(old)), None)
                if found is not None:
                    weights[found[1] + key.removeprefix(found[0])] = f.get_tensor(key)
    tower = TOWERS[family](config)
    tower.load_state_dict(weights, strict=True)
    return tower.to(device, dtype).eval()
