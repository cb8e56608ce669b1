"""One-query attention over quantized rows read as their integers cast to floats (the CPU's decode reading).

A stored row holds x = q * scale + bias per group of `group` elements, q the integers (kv_storage.py's
`QuantizedRows`). Per group g of a head, for a query u and attention weights w over the keys t:

    u . x = scale_g (u_g . q_g) + bias_g sum(u_g)
    sum_t w_t x_t = sum_t (w_t scale_t,g) q_t,g + sum_t w_t bias_t,g

so the integers are cast (one pass writing floats) and the scales and biases multiply the scores and the
weights, a query's width each, not every element: the dequantized reading costs two more passes (the
multiply and the add), and MLX's CPU `quantized_matmul` is slower still (docs/kv-budget.md). The cast is
made a span of keys at a time (`CHUNK_BYTES`), each span's products reading it while it is in the core's
cache; a pass whose whole copy would pass DEQUANTIZED_BYTES reads through `quantized_matmul` as before
(`QuantizedRows.reading`). With several groups a row, each query is lifted to one row per group (its group's
dims, zeros elsewhere: `blocks`), so each product stays one matrix product over whole rows. int4's bytes
hold two elements, the even one in the low nibble: the low and the high nibbles are cast as two arrays
of columns, read by the even and the odd dims.

mlx-lm's attention (`mlx_lm.models.base.scaled_dot_product_attention`, which the models call) sends a
cache that has `bits` to `quantized_scaled_dot_product_attention`, looked up in its module at call time:
`install` puts `attention` there, which reads a `CastIntegers` of one query a row this way and hands
anything else to mlx-lm's function. A `CastIntegers` is the (integers, scales, biases) that function
takes, so without the hook it reads the same rows through `mx.quantized_matmul`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
from mlx_lm.models import base

MLX_LM_ATTENTION = base.quantized_scaled_dot_product_attention
# The most bytes of the cast copy made at once: the integers are cast a span of keys at a time (every row and
# head), each span read by its products while it is still in the core's cache (faster than one copy of the
# layer once that passes 1 MiB, and smaller: docs/benchmarks.md, "On MLX (the CPU)")
CHUNK_BYTES = 2**20


class CastIntegers(tuple):
    """A pass's keys or values (integers, scales, biases), as `QuantizedRows.parts`, to read cast (`attention`)."""


@functools.cache
def blocks(groups: int, width: int, dtype: mx.Dtype) -> mx.array:
    """[groups, width]: 1 where a column of `width` belongs to the group (whole blocks of width / groups), else 0."""
    return (mx.arange(width)[None] // (width // groups) == mx.arange(groups)[:, None]).astype(dtype)


def chunks(words: mx.array, bits: int, dtype: mx.Dtype) -> list[tuple[slice, list[mx.array]]]:
    """The integers of `words` ([B, kv, t, dim * bits / 32] uint32) in `dtype`, in spans of keys whose copy is at
    most CHUNK_BYTES: (span, its columns), int8's [B, kv, keys, dim]; int4's low nibbles (the even dims) and high
    nibbles (the odd dims), [B, kv, keys, dim / 2] each (little-endian bytes)."""
    b, kv, t, width = words.shape
    step = max(1, CHUNK_BYTES // (b * kv * width * 32 // bits * dtype.size))
    out = []
    for start in range(0, t, step):
        span = slice(start, min(start + step, t))
        q = words[..., span, :].view(mx.uint8)
        out.append((span, [q.astype(dtype)] if bits == 8 else [(q & 15).astype(dtype), (q >> 4).astype(dtype)]))
    return out


def scores(q: mx.array, keys: CastIntegers, bits: int, group: int) -> mx.array:
    """q . k for queries q [B, kv, n, dim] (scaled) over the keys, [B, kv, n, t]."""
    words, scales, biases = keys
    b, kv, n, dim = q.shape
    groups, pieces = scales.shape[-1], 8 // bits
    lift = blocks(groups, dim // pieces, q.dtype)
    # each group's dims alone, one row a group, for each piece's columns: [B, kv, n * groups, dim / pieces]
    lifted = [(q[..., p::pieces][..., None, :] * lift).reshape(b, kv, n * groups, -1) for p in range(pieces)]
    dots = mx.concatenate([sum((x @ c.swapaxes(-1, -2) for x, c in zip(lifted[1:], columns[1:])),
                               lifted[0] @ columns[0].swapaxes(-1, -2))
                           for _, columns in chunks(words, bits, q.dtype)], axis=-1)
    dots = (dots.reshape(b, kv, n, groups, -1) * scales.swapaxes(-1, -2)[:, :, None]).sum(-2)
    return dots + q.reshape(b, kv, n, groups, group).sum(-1) @ biases.swapaxes(-1, -2)


def weighted(w: mx.array, values: CastIntegers, bits: int, group: int) -> mx.array:
    """sum_t w_t v_t for weights w [B, kv, n, t] over the values, [B, kv, n, dim]."""
    words, scales, biases = values
    b, kv, n, _ = w.shape
    groups = scales.shape[-1]
    scaled = (w[..., None, :] * scales.swapaxes(-1, -2)[:, :, None]).reshape(b, kv, n * groups, -1)
    totals: list[mx.array] = []  # a piece's: each group's row of weights against every column
    for span, columns in chunks(words, bits, w.dtype):
        products = [scaled[..., span] @ c for c in columns]
        totals = [t + p for t, p in zip(totals, products)] if totals else products
    lift = blocks(groups, totals[0].shape[-1], w.dtype)
    parts = [(t.reshape(b, kv, n, groups, -1) * lift).sum(-2) for t in totals]  # the dims of each row's own group
    out = parts[0] if len(parts) == 1 else mx.stack(parts, axis=-1).reshape(b, kv, n, -1)
    return out + mx.repeat(w @ biases, group, axis=-1)


def attention(queries: mx.array, q_keys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, reading `CastIntegers` of one query a row cast."""
    b, heads, length, dim = queries.shape
    if not (isinstance(q_keys, CastIntegers) and length == 1):
        return MLX_LM_ATTENTION(queries, q_keys, q_values, scale, mask, group_size, bits)
    kv = q_keys[0].shape[-3]
    s = scores((queries * scale).reshape(b, kv, heads // kv, dim), q_keys, bits, group_size)
    s = s.reshape(b, heads, 1, -1)
    if isinstance(mask, mx.array):  # a str is "causal": one query, the last position, attends every key
        s = mx.where(mask, s, mx.finfo(s.dtype).min) if mask.dtype == mx.bool_ else s + mask
    w = mx.softmax(s, axis=-1, precise=True).reshape(b, kv, heads // kv, -1)
    return weighted(w, q_values, bits, group_size).reshape(b, heads, 1, -1)


def install() -> None:
    """mlx-lm's attention reads `CastIntegers` through `attention` from now on (the MLX backend's load calls it)."""
    base.quantized_scaled_dot_product_attention = attention
