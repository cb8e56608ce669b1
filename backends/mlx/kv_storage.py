"""How the MLX backend stores a layer's keys and values (--kv-cache-dtype), inside mlx-lm's caches.

Every storage keeps a head's token as one row along the last axis, so a stored array is
[batch, kv_heads, tokens, width] like the plain one: mlx-lm's caches (`KVCache`, `RotatingKVCache` and
their batch forms) grow, pad, roll, merge, filter and slice it along the token axis as they do plain
keys, and so do kvfork's clones (kvcopy.py), the decode batch (batch.py) and saved states, without
knowing what a row holds.

- `FloatRows`: float16 or bfloat16 elements; attention reads them cast to the weights' dtype.
- `QuantizedRows`: `mx.quantize`'s `bits`-bit integers in groups of `group` along the head (packed in
  uint32 words), then each group's float16 scale and bias as one uint32 word (x = q * scale + bias),
  as mlx-lm's `QuantizedKVCache` groups them. On a GPU attention reads the integers directly: for the
  pass, the cache has `bits` and `group_size`, so mlx-lm's attention takes its
  `quantized_scaled_dot_product_attention` (`mx.quantized_matmul`). On the CPU, where that kernel is
  slow, a decode pass (one query a row) reads the rows in place through kv_reading.c, or where it cannot be
  built their integers cast to floats, the scales and biases applied to the scores and the weights
  (cpu_attention.py, which routes mlx-lm's quantized attention there), and a prefill or verify pass reads the
  rows dequantized through `mx.fast.scaled_dot_product_attention` (`QuantizedRows.reading`); with
  --batch-invariant every pass reads them in place, in one order (`QuantizedRows.ordered`, ordered.py).

The caches here (`StoredCache`) encode what a layer writes and hand attention what it reads from the
stored rows, the positions just written included, so what a query attends depends only on the stored
rows: a clone, a prefix cache entry or a saved file, holding the same rows, answers as the session
that wrote them.

int4 keys are stored rotated (`KVStorage.rotates_keys`): each head's key k as k @ H, H the normalised
Sylvester Hadamard matrix of the head size (orthogonal), and its query as q @ H, so q @ H @ (k @ H).T =
q @ k.T. Both pass through the attention's RoPE module, which `rotate_keys` follows with the rotation
(`mx.hadamard_transform`): a channel with outliers is spread over the head before the groups take
their scales. Values are stored as they are, so the attention's output needs no rotation back.
"""

from __future__ import annotations

import enum
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

from kvfork.backends import kv_reading
from kvfork.backends.base import KVStorage, KVStorageRefused
from kvfork.backends.mlx.cpu_attention import CastIntegers, OrderedRows, StoredRows

FLOAT16_MAX = 65504.0
FLOATS = {"float16": mx.float16, "bfloat16": mx.bfloat16}
# The most bytes a pass's dequantized copy of one layer's keys and values (for the rows in the pass) may take;
# a pass that would need more reads the integers, which need no copy: the copy is working memory beside the KV
# budget, so its size is bounded (8 KV heads of 128 in float32 reach it at 32k tokens, the default model's 3
# of 64 at 175k).
DEQUANTIZED_BYTES = 256 * 2**20


class Reading(enum.Enum):
    """How one attention pass reads a layer's stored rows (`reading`)."""

    ROWS = "the rows in the weights' dtype, through mx.fast.scaled_dot_product_attention"
    QUANTIZED_MATMUL = "the integers, through mlx-lm's quantized attention (mx.quantized_matmul)"
    IN_PLACE = "the stored rows, read where they lie by kv_reading.c (cpu_attention.py)"
    CAST = "the integers cast, the scales and biases applied to scores and weights (cpu_attention.py)"


class FloatRows:
    def __init__(self, stored: mx.Dtype, compute: mx.Dtype):
        self.dtype, self.compute = stored, compute

    def row_bytes(self, dim: int) -> int:
        return dim * self.dtype.size

    def encode(self, x: mx.array) -> mx.array:
        return x.astype(self.dtype)

    def reading(self, queries: int, keys: mx.array, values: mx.array) -> Reading:
        return Reading.ROWS

    def attended(self, stored: mx.array, reading: Reading = Reading.ROWS) -> mx.array:
        return stored.astype(self.compute)


class QuantizedRows:
    def __init__(self, bits: int, group: int, compute: mx.Dtype, integer_attention: bool,
                 kernel: kv_reading.Library | None = None, ordered: bool = False):
        self.bits, self.group, self.compute = bits, group, compute
        self.integer_attention = integer_attention  # every pass reads the integers (`attends_integers`)
        self.kernel = kernel  # kv_reading.c, which then reads a decode pass's rows in place
        self.ordered = ordered  # --batch-invariant: every pass reads the rows in place, in one order (ordered.py)

    def row_bytes(self, dim: int) -> int:
        return dim * self.bits // 8 + 4 * (dim // self.group)  # the integers; a float16 scale and bias a group

    def encode(self, x: mx.array) -> mx.array:
        x = mx.clip(x, -FLOAT16_MAX, FLOAT16_MAX).astype(mx.float16)  # scales and biases come out in float16
        q, scales, biases = mx.quantize(x, group_size=self.group, bits=self.bits)
        pairs = mx.stack([scales, biases], axis=-1).view(mx.uint32)[..., 0]  # one word a group
        return mx.concatenate([q, pairs], axis=-1)

    def dim(self, width: int) -> int:
        """The head size of a stored row `width` words wide."""
        return width * 32 * self.group // (self.bits * self.group + 32)

    def parts(self, stored: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(integers, scales, biases) as `mx.quantized_matmul` reads them, scales and biases in the weights' dtype."""
        words = self.dim(stored.shape[-1]) * self.bits // 32
        pairs = stored[..., words:].view(mx.float16).astype(self.compute)
        return stored[..., :words], pairs[..., 0::2], pairs[..., 1::2]

    def dequantized(self, stored: mx.array) -> mx.array:
        """The rows in the weights' dtype, x = q * scale + bias: what `mx.dequantize` computes, bit for bit, in
        elementwise operations over the integers' bytes (in half the time of its CPU kernel, measured)."""
        words, scales, biases = self.parts(stored)
        q = words.view(mx.uint8)  # little-endian: an int4 byte holds an element in its low half, the next in its high
        if self.bits == 4:
            q = mx.stack([q & 15, q >> 4], axis=-1)
        q = q.reshape(*scales.shape, self.group).astype(self.compute)
        return (q * scales[..., None] + biases[..., None]).reshape(*stored.shape[:-1], -1)

    def reading(self, queries: int, keys: mx.array, values: mx.array) -> Reading:
        """How a pass of `queries` new positions a row, over these stored `keys` and `values`, reads them: the
        integers through `mx.quantized_matmul` in every pass where `integer_attention`; else one query a row
        (decode) reads the rows in place through the kernel, or without one the integers cast (a span of keys at
        a time: `cpu_attention.CHUNK_BYTES`), and more (prefill, verify) the rows dequantized, but where that copy
        would pass DEQUANTIZED_BYTES: then the integers through `mx.quantized_matmul` (docs/kv-budget.md)."""
        if self.integer_attention:
            return Reading.QUANTIZED_MATMUL
        if queries == 1 or self.ordered:
            return Reading.CAST if self.kernel is None else Reading.IN_PLACE
        copy = sum(a.size // a.shape[-1] * self.dim(a.shape[-1]) for a in (keys, values)) * self.compute.size
        return Reading.QUANTIZED_MATMUL if copy > DEQUANTIZED_BYTES else Reading.ROWS

    def attended(self, stored: mx.array, reading: Reading) -> mx.array | tuple:
        """What attention reads: the dequantized rows, the stored ones (`StoredRows`), or the parts (`CastIntegers`
        to read them cast)."""
        if reading is Reading.ROWS:
            return self.dequantized(stored)
        if reading is Reading.IN_PLACE:
            return (OrderedRows if self.ordered else StoredRows)((stored, self.dim(stored.shape[-1]), self.kernel))
        return CastIntegers(self.parts(stored)) if reading is Reading.CAST else self.parts(stored)


Storage = FloatRows | QuantizedRows


def in_place_kernel(dims: tuple[int, ...]) -> kv_reading.Library | None:
    """kv_reading.c where a decode pass reads the rows on the CPU and it takes heads of `dims`, else None."""
    return None if attends_integers() or max(dims) > kv_reading.MOST_DIMS else kv_reading.library()


def attends_integers() -> bool:
    """Whether attention reads quantized rows as integers (`mx.quantized_matmul`) in every pass: on a GPU, where
    its kernel is the fast one; on the CPU decode reads the rows in place (or their integers cast) and prefill
    the rows dequantized (`QuantizedRows.reading`; docs/kv-budget.md has the measurements)."""
    return mx.default_device() == mx.gpu


def storage_for(spec: KVStorage, compute: mx.Dtype, dims: tuple[int, ...], attended: bool = False,
                ordered: bool = False) -> Storage | None:
    """The storage `spec` names for heads of `dims` (keys', values') computed in `compute`; None where the
    caches keep mlx-lm's own (the weights' dtype). `attended`: the storage a loaded model's attention reads,
    given kv_reading.c where a decode pass reads its rows in place (`in_place_kernel`); a storage only priced
    builds nothing. `ordered`: every pass reads the rows in place, in one order (--batch-invariant).
    KVStorageRefused where MLX or the head size cannot take it."""
    if spec.dtype == "auto" or (spec.dtype in FLOATS and FLOATS[spec.dtype] == compute):
        return None
    if spec.dtype in FLOATS:
        return FloatRows(FLOATS[spec.dtype], compute)
    if spec.bits is None:
        raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: MLX has no such storage; choose int8 (as small, "
                               "with a scale and bias per group)")
    for dim in dims:
        if dim % spec.group:
            raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: head size {dim} is not a multiple of "
                                   f"--kv-group-size {spec.group}")
    if spec.rotates_keys and dims[0] & (dims[0] - 1):
        raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: head size {dims[0]} is not a power of two, "
                               "which its keys' Hadamard rotation needs")
    return QuantizedRows(spec.bits, spec.group, compute, integer_attention=attends_integers(),
                         kernel=in_place_kernel(dims) if attended else None, ordered=ordered)


def row_bytes(storage: Storage | None, compute: mx.Dtype, dim: int) -> int:
    """Bytes of one head's token, one side (keys or values), as `storage` keeps it."""
    return dim * compute.size if storage is None else storage.row_bytes(dim)


class StoredCache:
    """An mlx-lm KV cache holding rows as `storage` writes them (`stored` makes one)."""

    storage: Storage

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        queries = keys.shape[-2]
        # a mixin: the mlx-lm cache class it comes before in each class below has update_and_fetch
        keys, values = super().update_and_fetch(  # type: ignore[misc]
            self.storage.encode(keys), self.storage.encode(values))
        reading = self.storage.reading(queries, keys, values)
        # mlx-lm's attention sends a cache that has `bits` to its quantized attention (cpu_attention.install
        # routes StoredRows and CastIntegers from there): this pass's reading
        if reading is Reading.ROWS:
            vars(self).pop("bits", None)
        else:
            self.bits, self.group_size = self.storage.bits, self.storage.group  # type: ignore[union-attr]
        return self.storage.attended(keys, reading), self.storage.attended(values, reading)


class StoredKV(StoredCache, KVCache):
    @classmethod
    def merge(cls, caches):
        return stored(StoredBatchKV.merge(caches), caches[0].storage)


class StoredRing(StoredCache, RotatingKVCache):
    @classmethod
    def merge(cls, caches):
        return stored(StoredBatchRing.merge(caches), caches[0].storage)


class StoredBatchKV(StoredCache, BatchKVCache):
    def extract(self, idx):
        return stored(super().extract(idx), self.storage)


class StoredBatchRing(StoredCache, BatchRotatingKVCache):
    def extract(self, idx):
        return stored(super().extract(idx), self.storage)


STORED = {KVCache: StoredKV, RotatingKVCache: StoredRing, BatchKVCache: StoredBatchKV,
          BatchRotatingKVCache: StoredBatchRing}


def stored(cache: Any, storage: Storage | None) -> Any:
    """`cache` (an mlx-lm KV cache, or a recurrent state: returned as it is) writing and reading `storage`'s rows;
    the cache itself where storage is None (the weights' dtype)."""
    if storage is None or not isinstance(cache, tuple(STORED)):
        return cache
    if not isinstance(cache, StoredCache):
        kind = STORED[type(cache)]
        adopted = kind.__new__(kind)
        adopted.__dict__.update(vars(cache))
        cache = adopted
    cache.storage = storage
    return cache


def refuse_sinks(model: nn.Module, spec: KVStorage) -> None:
    """KVStorageRefused where the model's attention has sinks (gpt-oss): mlx-lm's quantized attention, which reads
    quantized rows on a GPU and at decode on the CPU, has none (it raises at the pass)."""
    if any("sinks" in module for _, module in model.named_modules()):
        raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: this model's attention has sinks, which mlx-lm's "
                               "quantized attention does not read; choose float16 or bfloat16")


class RotatedRoPE(nn.Module):
    """An attention's RoPE, then each head rotated by the normalised Hadamard matrix (queries and keys alike)."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return mx.hadamard_transform(self.rope(x, *args, **kwargs), scale=x.shape[-1] ** -0.5)


def rotate_keys(model: nn.Module, attention_layers: int, spec: KVStorage) -> None:
    """Follow every attention's RoPE module with the rotation: its queries and keys are then rotated, and
    its keys stored so. KVStorageRefused where the model's attention layers do not each have one."""
    owners = [m for _, m in model.named_modules() if isinstance(m.get("rope"), nn.Module)]
    if len(owners) != attention_layers:
        raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: kvfork rotates keys through each attention's RoPE "
                               f"module, and this model has {len(owners)} for {attention_layers} attention layers")
    for owner in owners:
        owner["rope"] = RotatedRoPE(owner["rope"])
