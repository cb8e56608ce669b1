"""A torch session's layers to and from the host layout of the saved-state rule (base.SavedState):
what the disk tier writes and reads, and what a tensor-parallel rank hands on as its shard.

A full layer leaves as its keys and values of [0, position) joined from its block table's runs; a
ring as the entries it still holds, [held_from, position), put in position order; a recurrent
state as its two tensors. Keys and values leave as stored (--kv-cache-dtype, kv_storage.py) and come
back into the same storage without a round trip through the weights' dtype. bfloat16 travels as its
uint16 bits (numpy has no bfloat16).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvfork.backends.base import SavedLayer, SavedState
from kvfork.backends.torch import kv
from kvfork.backends.torch.gated_delta import RecurrentState
from kvfork.backends.vision.positions import RopeShifts


def export(layers: Sequence[kv.LayerKV | RecurrentState], position: int, device: torch.device,
           rope_shifts: RopeShifts = ()) -> SavedState:
    """The state of [0, position) held by `layers` (a session's, in model order), as host arrays, with its
    M-RoPE shifts."""
    n, saved = position, []
    for layer in layers:
        match layer:
            case kv.FullKV():
                saved.append(SavedLayer("full", tuple(_host(t) for t in layer.read(n))))
            case kv.RingKV():
                first = max(layer.held_from, n - layer.window, 0)
                entries = torch.arange(first, n, device=device) % layer.window
                held = (_host(layer.keys[:, entries]), _host(layer.values[:, entries]))
                saved.append(SavedLayer("sliding", held, first))
            case RecurrentState():
                saved.append(SavedLayer("recurrent", (_host(layer.conv), _host(layer.ssm))))
    return SavedState(n, tuple(saved), rope_shifts)


def import_into(layers: Sequence[kv.LayerKV | RecurrentState], state: SavedState, device: torch.device) -> None:
    """Write `state` into a fresh session's `layers`; a saved layer of another kind than its layer is refused."""
    n = state.position
    for layer, saved in zip(layers, state.layers, strict=True):
        arrays = [_device(a, device) for a in saved.arrays]
        match layer:
            case kv.FullKV() if saved.kind == "full":
                layer.reserve(n)
                layer.write(arrays[0], arrays[1], 0)
            case kv.RingKV() if saved.kind == "sliding":
                slots = torch.arange(saved.first, n, device=device) % layer.window
                layer.keys[:, slots], layer.values[:, slots] = arrays[0], arrays[1]
                layer.held_from = saved.first
            case RecurrentState() if saved.kind == "recurrent":
                layer.conv.copy_(arrays[0])
                layer.ssm.copy_(arrays[1])
            case _:
                raise ValueError(f"a saved {saved.kind} layer does not fit {type(layer).__name__}")


def _host(tensor: torch.Tensor):
    """A tensor as a numpy array on the host: bfloat16 as its uint16 bits."""
    tensor = tensor.detach().to("cpu").contiguous()
    return (tensor.view(torch.uint16) if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _device(array, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if tensor.dtype == torch.uint16:  # bfloat16 bits
        tensor = tensor.view(torch.bfloat16)
    return tensor.to(device)
