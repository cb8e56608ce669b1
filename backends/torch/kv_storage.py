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
  scales, then the biases, as bytes. Attention reads it without a dequantized copy (`scores`, `block_sums`): on
  the CPU through kv_reading.c where it builds (integer_reading.py), else through torch's products.

int4 keys are stored rotated (`KVStorage.rotates_keys`): each head's key k is stored as k @ H, H the
normalised Sylvester Hadamard matrix of the head size (orthogonal: H @ H.T = I), and attention rotates
its queries the same way (`queries`), so q @ H @ (k @ H).T = q @ k.T. A channel with outliers, which
would set every scale of its group, is spread over the whole head before the groups are formed. Values
are stored as they are (tools/kv_accuracy_bench.py measured rotating them too: docs/kv-budget.md), so the
attention's output needs no rotation back.

A state is written encoded and read back decoded, the positions just written included, so what a
query attends depends only on the stored rows: a clone, a prefix cache entry or a saved file,
holding the same rows, answers as the session that wrote them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from kvfork.backends.base import KVStorage, KVStorageRefused
from kvfork.backends.kv_reading import MOST_DIMS
from kvfork.backends.torch import integer_reading
from kvfork.backends.torch.integer_reading import Kernel

FP8_MAX = 448.0  # float8 e4m3's largest finite value
LOW_NIBBLES, HIGH_NIBBLES = 0x0F0F0F0F, -0x0F0F0F10  # int32 masks of each byte's low and high nibble (0xF0F0F0F0)


def working_memory(held: dict[tuple, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype,
                   device) -> torch.Tensor:
    """A [shape] view of working memory kept in `held` by (device, dtype), reused by every call: read it before
    the next call. A fresh tensor per call faults its pages in first, which costs more than the copy into it
    on the CPU."""
    key, count = (torch.device(device), dtype), math.prod(shape)
    memory = held.get(key)
    if memory is None or memory.numel() < count:
        memory = held[key] = torch.empty(count, dtype=dtype, device=device)
    return memory[:count].view(shape)


def hadamard(n: int) -> torch.Tensor:
    """The normalised n x n Sylvester Hadamard matrix (float64; n a power of two): symmetric and
    orthogonal, so H @ H = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"no Sylvester Hadamard matrix of size {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def batched_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm(a, b) run as a batch of two or more: torch hands a batch of one to the BLAS's sgemm, which a
    preloaded BLAS replaces (OpenBLAS, which MLX wants: mlx/blas.py), and OpenBLAS sums a column in an order
    that depends on how many columns it is given; a larger batch stays in torch's own batched products, which
    do not (measured). The invariant paths' products go through here."""
    if a.shape[0] > 1:
        return torch.bmm(a, b)
    return torch.bmm(a.expand(2, *a.shape[1:]), b.expand(2, *b.shape[1:]))[:1]


# The fewest columns an invariant product is given: MKL gives a column the same bits in every product of at least
# this many columns, wherever it stands among them, and other bits in smaller ones (measured: 2 columns on an
# Intel Xeon, 12 on an AMD EPYC with AVX-512); ordered_attention.unordered_products checks it at load
LEAST_COLUMNS = 16


def zero_padded(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """x with zeros after its own along `dim` up to `size`, where it has fewer."""
    short = size - x.shape[dim]
    if short <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat((x, x.new_zeros(shape)), dim)


def at_least_columns(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x with zero columns after its own along `dim` up to LEAST_COLUMNS, where it has fewer."""
    return zero_padded(x, dim, LEAST_COLUMNS)


def blocks(w: torch.Tensor, v: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Weights [kv_heads, n, t] and values [kv_heads, t, width] in blocks of `size` positions (the last may be
    shorter): ([kv_heads, blocks, n, size], [kv_heads, blocks, size, width]) for the whole ones, then the rest."""
    whole, t = v.shape[1] // size * size, v.shape[1]
    out = []
    if whole:
        # contiguous once: the storage's products would each copy the transposed weights
        w_blocks = w[..., :whole].unflatten(-1, (-1, size)).transpose(1, 2).contiguous()
        out.append((w_blocks, v[:, :whole].unflatten(1, (-1, size))))
    if whole < t:
        out.append((w[..., whole:][:, None], v[:, whole:][:, None]))
    return out


class Storage:
    """One side's storage; keys and values are written through `encode_kv` and queries read through
    `queries`, which rotate keys and queries where `rotation` is set (a [head_dim, head_dim] orthogonal
    matrix in the compute dtype)."""

    rotation: torch.Tensor | None = None
    dtype: torch.dtype  # the stored tensors' elements
    exact: bool = False  # whether `decode` gives the stored tensor itself
    # rows computed and read batch-invariantly (--batch-invariant): the rotation as `turned`, attention by
    # ordered_attention.py
    invariant: bool = False
    kernel: Kernel | None = None  # kv_reading.c, where it reads the stored rows (`Grouped` on the CPU)

    def width(self, head_dim: int) -> int:
        """Elements of a stored row holding one head's `head_dim` values."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_into(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """Stored rows [kv_heads, t, width] decoded into `out` [kv_heads, t, head_dim]."""
        out.copy_(self.decode(stored))

    def scores(self, q: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """q [kv_heads, n, head_dim] against stored keys [kv_heads, t, width]: q @ k.T, [kv_heads, n, t]."""
        return torch.matmul(q, self.decode(stored).transpose(-1, -2))

    def weighted(self, w: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        """Weights [..., n, t] of stored values [..., t, width]: w @ v, [..., n, head_dim] (float32)."""
        return torch.matmul(w, self.decode(stored)).float()

    def block_sums(self, w: torch.Tensor, stored: torch.Tensor, size: int) -> torch.Tensor:
        """Weights [kv_heads, n, t] of stored values [kv_heads, t, width], summed per block of `size` positions
        (`weighted` of each): [kv_heads, blocks, n, head_dim] (float32)."""
        return torch.cat([self.weighted(wb, vb) for wb, vb in blocks(w, stored, size)], dim=1)

    def encode_kv(self, k: torch.Tensor, v: torch.Tensor,
                  rows: Sequence[slice] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ([kv_heads, tokens, head_dim]) as stored, keys rotated where `rotation` is set."""
        return self.encode(self.rotated(k, rows)), self.encode(v)

    def rotated(self, k: torch.Tensor, rows: Sequence[slice] = ()) -> torch.Tensor:
        """Keys in the basis they are stored in: rotated where `rotation` is set, row by row where `rows` (a
        pass's rows, at slices of the token dimension) are given, since a product's rounding depends on its
        shape and a row's stored bytes are to be those it gets in any batch (batch-invariantly: `turned`, which
        gives each token the same bits in a product of any tokens)."""
        if self.rotation is None:
            return k
        if self.invariant:
            return self.turned(k)
        if len(rows) < 2:
            return k @ self.rotation
        return torch.cat([k[:, row] @ self.rotation for row in rows], dim=1)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """Queries in the basis the stored keys are in."""
        if self.rotation is None:
            return q
        return self.turned(q) if self.invariant else q @ self.rotation

    def turned(self, x: torch.Tensor) -> torch.Tensor:
        """x [heads, tokens, head_dim] @ rotation, batch-invariantly: one batched product of the rotation by each
        head's tokens as columns, LEAST_COLUMNS or more, so a token's rounding does not depend on how many tokens
        the product is given, as it does where they are its rows, or where a product has few columns."""
        assert self.rotation is not None
        rotation = self.rotation.t().expand(x.shape[0], *self.rotation.shape)
        return batched_product(rotation, at_least_columns(x.transpose(1, 2)))[..., :x.shape[1]].transpose(1, 2)


class Plain(Storage):
    def __init__(self, stored: torch.dtype, compute: torch.dtype):
        self.dtype, self.compute = stored, compute
        self.exact = stored == compute  # decode is the stored tensor itself

    def width(self, head_dim: int) -> int:
        return head_dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return stored.to(self.compute)


class Float8(Storage):
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


class Grouped(Storage):
    exact = False
    dtype = torch.uint8

    def __init__(self, bits: int, group: int, head_dim: int, compute: torch.dtype, rotates_keys: bool = False,
                 kernel: Kernel | None = None):
        """`kernel`: kv_reading.c, which then reads the rows of CPU tensors (a decode row's scores and sums, the
        rows decoded: integer_reading.py); torch's operations read them otherwise."""
        self.bits, self.group, self.compute, self.head_dim, self.kernel = bits, group, compute, head_dim, kernel
        if rotates_keys:
            self.rotation = hadamard(head_dim).to(compute)
        self.groups = head_dim // group
        self.levels = 2**bits - 1
        self.packed = head_dim * bits // 8  # bytes of integers per row
        row = self.width(head_dim)
        # Attention reads a row's integers as float32 in `parts` (`integers`), each a row's width of columns:
        # int8's one part is the row's bytes; int4's two are the low nibble of every byte, then the high nibble
        # of every byte in place (16x its value: byte & 240). The scales' bytes come along as columns no dim
        # reads, so every row is copied whole. Dim d sits in column `column[d]` of the parts side by side
        # (part p's column c is column p * width + c) with factor `unit[d]` (1, or 1/16 for a high nibble: a
        # power of two, so every product is the one over the plain integers).
        self.parts = 2 if bits == 4 else 1
        self.columns = self.parts * row
        dims = torch.arange(head_dim)
        column = dims // 2 + row * (dims % 2) if bits == 4 else dims
        unit = torch.ones(head_dim, dtype=torch.float64)
        if bits == 4:
            unit[1::2] = 1 / 16
        # `lift` takes a query to one row per group over the columns (its group's dims in their columns,
        # times their factor, zeros elsewhere), then each group's sum of the query (for the biases):
        # q @ lift = [group 0's row | group 1's row | ... | sums].
        lift = torch.zeros(head_dim, self.groups * self.columns + self.groups, dtype=torch.float64)
        lift[dims, dims // group * self.columns + column] = unit
        lift[dims, self.groups * self.columns + dims // group] = 1.0
        self.constants = {torch.device("cpu"): (lift.float(), unit.float())}  # device -> them
        self.scratch: dict[tuple, torch.Tensor] = {}  # (device, dtype) -> working memory of the runner thread

    def width(self, head_dim: int) -> int:
        return self.packed + 4 * self.groups  # float16 scale and bias per group

    def placed(self, device) -> tuple[torch.Tensor, ...]:
        """`lift` and `unit` on `device`: copied there once, not per call (a copy per layer and step on CUDA)."""
        device = torch.device(device)
        held = self.constants.get(device)
        if held is None:
            held = self.constants[device] = tuple(x.to(device) for x in self.constants[torch.device("cpu")])
        return held

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        # few operations: a decode step encodes one token per layer, where each operation's fixed cost,
        # not its elements, is the time
        lead = x.shape[:-1]
        xs = x.float().reshape(*lead, self.groups, self.group)
        low, high = torch.aminmax(xs, dim=-1)
        scale = torch.where(high > low, (high - low) / self.levels, 1.0).clamp_max_(65504.0)
        halves = torch.cat((scale, low), -1).half()  # [..., 2 * groups]: the 16-bit values decode reads, as stored
        read = halves.float()[..., None]
        q = xs.sub(read[..., self.groups :, :]).div_(read[..., : self.groups, :]).round_().clamp_(0, self.levels)
        if self.bits == 4:
            q = torch.add(q[..., 0::2], q[..., 1::2], alpha=16)  # a byte's value: its low nibble + 16 x its high
        return torch.cat((q.reshape(*lead, -1).to(torch.uint8), halves.view(torch.uint8)), dim=-1)

    def encode_kv(self, k: torch.Tensor, v: torch.Tensor,
                  rows: Sequence[slice] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values encoded together, the values' heads after the keys': one set of operations for both
        (`encode`)."""
        both = self.encode(torch.cat((self.rotated(k, rows), v)))
        return both[: k.shape[0]], both[k.shape[0] :]

    def integers(self, stored: torch.Tensor) -> torch.Tensor:
        """The rows' integers ([..., t, width] stored) as float32 in their parts (see `__init__`), each part's rows
        end to end: [parts, ..., t, width], a view of working memory (`working_memory`). Each pass runs over whole
        rows, which lie end to end, and writes a whole part."""
        out = working_memory(self.scratch, (self.parts, *stored.shape), torch.float32, stored.device)
        if self.bits == 8:
            return out.copy_(stored)
        # four bytes an operation (an int4 row is whole 32-bit words: its head size is a multiple of a group, 32
        # or more, so its integers and its scales each fill whole words): measured 1.4x faster than the same
        # masks over bytes, and 1.5x faster again (with the cast) than both nibbles side by side in each row
        nibbles = working_memory(self.scratch, (self.parts, *stored.shape), torch.uint8, stored.device)
        low, high = nibbles.view(torch.int32)
        torch.bitwise_and(stored.view(torch.int32), LOW_NIBBLES, out=low)
        torch.bitwise_and(stored.view(torch.int32), HIGH_NIBBLES, out=high)
        return out.copy_(nibbles)

    def scales(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' scales and biases as float32, [..., groups] each. A row's 16-bit scales and biases are its
        last `groups` 32-bit words (its integers fill whole words: `integers`), gathered as words into working
        memory: the same gather over their bytes moves a quarter as much per element, which costs more."""
        words = stored.view(torch.int32)[..., self.packed // 4 :]
        both = working_memory(self.scratch, words.shape, torch.int32, stored.device).copy_(words)
        both = both.view(torch.float16).float()
        return both[..., : self.groups], both[..., self.groups :]

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and stored.is_cpu and stored.dim() == 3 and self.compute == torch.float32:
            out = torch.empty(*stored.shape[:-1], self.head_dim, dtype=torch.float32)
            self.kernel.decode(stored, out, self.bits, self.group)
            return out
        scale, bias = self.scales(stored)
        unit = self.placed(stored.device)[1]
        # dim d = parts * i + p is byte i's part p
        ints = torch.stack([part[..., : self.packed] for part in self.integers(stored)], -1).flatten(-2) * unit
        x = ints.unflatten(-1, (self.groups, -1)) * scale[..., None] + bias[..., None]
        return x.flatten(-2).to(self.compute)

    def decode_into(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        if self.kernel is not None and stored.is_cpu and out.dtype == torch.float32 and out.stride(-1) == 1:
            self.kernel.decode(stored, out, self.bits, self.group)
        else:
            out.copy_(self.decode(stored))

    # Attention reads the integers without a dequantized copy (x = q * scale + bias, per group g):
    # k . x = sum_g scale_g (k_g . q_g) + bias_g sum(k_g), and sum_t w_t x_t = sum_t (w_t scale_t) q_t
    # + sum_t w_t bias_t: the scales and biases multiply scores, not elements. kv_reading.c computes these sums
    # in one pass over the stored bytes; torch's products (below) cast the integers first.

    def scores(self, q: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and stored.is_cpu:
            return self.kernel.scores(q.float(), stored, self.bits, self.group)
        scale, bias = (x.transpose(-1, -2) for x in self.scales(stored))  # [kv, groups, t]
        lift = self.placed(q.device)[0]
        read = q.float() @ lift  # [kv, n, groups * columns + groups]
        split = self.groups * self.columns
        rows = read[..., :split].reshape(q.shape[0], -1, self.columns)  # [kv, n * groups, columns]
        # a product per part: measured faster than one over both parts side by side in each row, which the masks
        # write a row at a time
        ints, width = self.integers(stored).transpose(-1, -2), stored.shape[-1]  # [parts, kv, width, t]
        parts = rows.unflatten(-1, (self.parts, width)).movedim(-2, 0).contiguous()  # [parts, kv, n * groups, width]
        dots = torch.bmm(parts[0], ints[0])  # [kv, n * groups, t]
        for p in range(1, self.parts):
            dots.baddbmm_(parts[p], ints[p])
        if self.groups == 1:
            dots.mul_(scale)
        else:
            dots = (dots.unflatten(1, (-1, self.groups)) * scale[:, None]).sum(2)
        return torch.baddbmm(dots, read[..., split:], bias)

    def block_sums(self, w: torch.Tensor, stored: torch.Tensor, size: int) -> torch.Tensor:
        if self.kernel is not None and stored.is_cpu:
            return self.kernel.block_sums(w.float(), stored, self.bits, self.group, self.head_dim, size)
        return super().block_sums(w, stored, size)

    def block_and_weight_sums(self, w: torch.Tensor, stored: torch.Tensor,
                              size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`block_sums` and each block's sum of weights ([kv_heads, blocks, n], added by halves as
        ordered_attention.halved adds), from the kernel's one pass over the weights: where it reads the rows."""
        assert self.kernel is not None
        heads, n, t = w.shape
        weight_sums = w.new_empty(heads, -(-t // size), n, dtype=torch.float32)
        return self.kernel.block_sums(w.float(), stored, self.bits, self.group, self.head_dim, size,
                                      weight_sums), weight_sums

    def weighted(self, w: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        scale, bias = self.scales(stored)  # [..., t, groups]
        unit = self.placed(stored.device)[1]
        w = w.float()
        scaled = (w[..., None, :] * scale.transpose(-1, -2)[..., None, :, :]).flatten(-3, -2)  # [..., n * groups, t]
        out = torch.matmul(scaled, self.integers(stored)).unflatten(-2, (-1, self.groups))  # one product, every part
        biased = torch.matmul(w, bias)[..., None]  # [..., n, groups, 1]
        # out is [parts, ..., n, groups, width]: group g's dims are its own row's bytes [g * bytes, (g + 1) * bytes)
        # of each part, a view (the diagonal of [groups, groups, bytes]), where a copy through each dim's column
        # costs a pass over every query's columns
        own = out[..., : self.packed].unflatten(-1, (self.groups, -1)).diagonal(dim1=-3, dim2=-2).transpose(-1, -2)
        if self.parts == 1:  # int8: dim d is byte d with factor 1
            return torch.add(biased, own[0]).flatten(-2)
        # int4: dim (g, i, p) is part p of group g's byte i, times its factor
        return torch.addcmul(biased[..., None], own.movedim(0, -1), unit.view(self.groups, -1, self.parts)).flatten(-3)


FLOATS = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def storage_for(spec: KVStorage, compute: torch.dtype, head_dim: int, device: torch.device | None = None) -> Storage:
    """The storage `spec` names for heads of `head_dim` computed in `compute`; KVStorageRefused where
    the head size does not take it. On the CPU (`device`) int8 and int4 are read at decode by kv_reading.c where
    it builds (integer_reading.py)."""
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
    if spec.rotates_keys and head_dim & (head_dim - 1):
        raise KVStorageRefused(f"--kv-cache-dtype {spec.dtype}: head size {head_dim} is not a power of two, "
                               f"which its keys' Hadamard rotation needs")
    kernel = integer_reading.kernel() if device is not None and device.type == "cpu" and head_dim <= MOST_DIMS else None
    return Grouped(spec.bits, spec.group, head_dim, compute, spec.rotates_keys, kernel)


def row_bytes(storage: Storage, head_dim: int) -> int:
    """Bytes of one head's token, one side (keys or values)."""
    return storage.width(head_dim) * storage.dtype.itemsize
