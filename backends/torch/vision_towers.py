"""The vision towers of the vision-language models whose text model is ours with images (images.py):
Qwen2.5-VL and Gemma 3, transformers' vision modules, their weights read by backends/torch/vision.py. A
tower's `encode(arrays)` takes its family's pixel arrays (backends/vision/<family>.py's `pixels`)
to the embeddings that replace the image's tokens' [tokens, text hidden], and the (t, h, w) grid of those
tokens.

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


TOWERS: dict[str, type[nn.Module]] = {"qwen2_5_vl": Qwen2_5_VLTower, "gemma3": Gemma3Tower}
