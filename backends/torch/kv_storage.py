"""How the torch backend stores one side (keys or values) of a layer's KV state (--kv-cache-dtype).

Every storage keeps a head's token as one row along the last dimension, so a stored tensor is
[kv_heads, tokens, width] like the plain one: blocks, clones, rings, roll-backs and saved states
slice and copy it along the token dimension without knowing what a row holds.

- `Plain`: the elements in a floating type (the weights' dtype, float16, bfloat16). Where that is
  the weights' dtype, `decode` is the tensor itself: attention reads the buffers as they are.
- `Float8`: float8 e4m3 (saturated at +-448), kept as its bytes.
- `Grouped`: `bits`-bit integers in groups of `group` along the head dimension, each group with a
  float16 scale and bias (x = q * scale + bias, q in [0, 2^bits)), as mlx-lm's QuantizedKVCache
  groups them; a row is the packed integers (two 4-bit ones a byte, low nibble first), then the
  scales, then the biases, as bytes.

A state is written encoded and read back decoded, the positions just written included, so what a
query attends depends only on the stored rows: a clone, a prefix cache entry or a saved file,
holding the same rows, answers as the session that wrote them.
"""

from __future__ import annotations

import torch

from kvfork.backends.base import KVStorage, KVStorageRefused

FP8_MAX = 448.0  # float8 e4m3's largest finite value


class Plain:
    def __init__(self, stored: torch.dtype, compute: torch.dtype):
        self.dtype, self.compute = stored, compute
        self.exact = stored == compute  # decode is the stored tensor itself

    def width(self, head_dim: int) -> int:
        return head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.to(self.compute)


class Float8:
    exact = False
    dtype = torch.uint8

    def __init__(self, compute: torch.dtype):
        self.compute = compute

    def width(self, head_dim: int) -> int:
        return head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.view(torch.float8_e4m3fn).to(self.compute)


class Grouped:
    exact = False
    dtype = torch.uint8

    def __init__(self, bits: int, group: int, head_dim: int, compute: torch.dtype):
        self.bits, self.group, self.compute = bits, group, compute
        self.groups = head_dim // group
        self.levels = 2**bits - 1
        self.packed = head_dim * bits // 8  # bytes of integers per row

    def width(self, head_dim: int) -> int:
        return self.packed + 4 * self.groups  # float16 scale and bias per group

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xs = x.float().reshape(*lead, self.groups, self.group)
        low, high = xs.amin(-1), xs.amax(-1)
        scale = torch.where(high > low, (high - low) / self.levels, torch.ones_like(low))
        scale, bias = scale.clamp(max=65504.0).half(), low.half()  # the 16-bit values decode reads
        q = ((xs - bias.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, self.levels)
        q = q.to(torch.uint8).reshape(*lead, -1)
        if self.bits == 4:
            q = q[..., 0::2] | (q[..., 1::2] << 4)
        return torch.cat((q, scale.view(torch.uint8), bias.view(torch.uint8)), dim=-1)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        lead = stored.shape[:-1]
        q = stored[..., : self.packed]
        if self.bits == 4:
            q = torch.stack((q & 15, q >> 4), dim=-1)
        scale = stored[..., self.packed : self.packed + 2 * self.groups].contiguous().view(torch.float16)
        bias = stored[..., self.packed + 2 * self.groups :].contiguous().view(torch.float16)
        x = q.reshape(*lead, self.groups, self.group).float() * scale.float()[..., None] + bias.float()[..., None]
        return x.reshape(*lead, -1).to(self.compute)


Storage = Plain | Float8 | Grouped

FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def storage_for(spec: KVStorage, compute: torch.dtype, head_dim: int) -> Storage:
    """The storage `spec` names for heads of `head_dim` computed in `compute`; KVStorageRefused where
    the head size does not take it."""
    if spec.dtype == "auto":
        return Plain(compute, compute)
    if spec.dtype in FLOATS:
        return Plain(FLOATS[spec.dtype], compute)
    if spec.dtype == "fp8":
        return Float8(compute)
    assert spec.bits is not None, spec
    if head_dim % spec.group:
        raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: head size {head_dim} is not a multiple of "
                               f"--kv-group-size {spec.group}")
    return Grouped(spec.bits, spec.group, head_dim, compute)


def row_bytes(storage: Storage, head_dim: int) -> int:
    """Bytes of one head's token, one side (keys or values)."""
    return storage.width(head_dim) * storage.dtype.itemsize
