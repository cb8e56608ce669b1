"""One-query attention over quantized rows on the CPU (a decode pass): the stored rows read in place by
kv_reading.c, or, where it cannot be built, their integers cast to floats.

A stored row holds x = q * scale + bias per group of `group` elements, q the integers (kv_storage.py's
`QuantizedRows`). Per group g of a head, for a query u and attention weights w over the keys t:

    u . x = scale_g (u_g . q_g) + bias_g sum(u_g)
    sum_t w_t x_t = sum_t (w_t scale_t,g) q_t,g + sum_t w_t bias_t,g

so the scales and biases multiply the scores and the weights, a query's width each, not every element.

- **In place** (`StoredRows`, `read_in_place`): kv_reading.c (backends/kv_reading.py) computes each key's score
  and each block's weighted values from the stored bytes in one pass over the rows, with no float copy of them;
  the softmax between runs in NumPy. The kernel runs outside MLX's graph, so the pass's arrays are evaluated
  first and read through NumPy's views of MLX's buffers (no copy of the rows). One layer, one row, 8,000 keys:
  0.76 ms, against 2.84 ms cast and float32's 1.96 ms in `mx.fast.scaled_dot_product_attention`
  (tools/mlx_kv_attention_bench.py; docs/kv-budget.md, "Speed on MLX").
- **Cast** (`CastIntegers`, `read_cast`): the integers are cast (one pass writing floats) a span of keys at a
  time (`CHUNK_BYTES`), each span read by MLX's products while it is in the core's cache; the dequantized
  reading costs two more passes (the multiply and the add), and MLX's CPU `quantized_matmul` is slower still.
  With several groups a row, each query is lifted to one row per group (its group's dims, zeros elsewhere:
  `blocks`), so each product stays one matrix product over whole rows. int4's bytes hold two elements, the even
  one in the low nibble: the low and the high nibbles are cast as two arrays of columns, read by the even and
  the odd dims.

- **Ordered** (`OrderedRows`, `read_ordered`; --batch-invariant, ordered.py): every pass, prefill chunks' and
  verify rows' queries as decode rows', reads the rows in place in one order, so a query gets the same bits in
  any pass.

Otherwise a prefill or verify pass reads the rows dequantized, or through `quantized_matmul` where that copy
would pass DEQUANTIZED_BYTES (`QuantizedRows.reading`). mlx-lm's attention
(`mlx_lm.models.base.scaled_dot_product_attention`, which the models call) sends a cache that has `bits` to
`quantized_scaled_dot_product_attention`, looked up in its module at call time: `install` puts `attention`
there, which reads `OrderedRows`, and `StoredRows` and `CastIntegers` of one query a row, so and
hands anything else to mlx-lm's function. A `CastIntegers` is the (integers, scales, biases) that function takes,
so without the hook it reads the same rows through `mx.quantized_matmul`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx_lm.models import base

MLX_LM_ATTENTION = base.quantized_scaled_dot_product_attention
# The most bytes of the cast copy made at once: the integers are cast a span of keys at a time (every row and
# head), each span read by its products while it is still in the core's cache (faster than one copy of the
# layer once that passes 1 MiB, and smaller: docs/benchmarks.md, "On MLX (the CPU)")
CHUNK_BYTES = 2**20
# The kernel's threads: one. The process's OpenMP runtime is torch's where transformers imported it, and its idle
# threads spin, taking the cores from the BLAS threads of the layers between (a decode step at 2,048 tokens took
# 286 ms on two threads against 58 ms on one; float32's took 66-72 ms)
THREADS = 1
# Keys whose weighted values kv_reading.c sums apart, the blocks' sums then added here: shorter running sums round
# less than one over every key
BLOCK_TOKENS = 256
# Each group's float16 scale and bias side by side after a row's integers, as `QuantizedRows` packs them: group g's
# scale is float16 2g after the integers, its bias 2g + 1 (kv_reading.c's `halves`)
HALF_STEP, BIAS_FIRST = 2, 1
# The most bytes of scores `read_ordered` holds at once: fewer query columns a call where the keys are many (which
# changes no bits: a column's scores are its own)
SCORE_BYTES = 32 << 20


class StoredRows(tuple):
    """A pass's stored keys or values to read in place (`read_in_place`): (rows, dim, library), the rows
    [B, kv, t, width] uint32 as `QuantizedRows.encode` writes them, their head size, and kv_reading.c loaded."""


class OrderedRows(StoredRows):
    """`StoredRows` read in the order that makes a query's output the same bits in every pass (`read_ordered`)."""


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


def masked(s: mx.array, mask) -> mx.array:
    """Scores [B, heads, 1, t] (or a row of them that broadcasts) under mlx-lm's mask: a str is "causal", and one
    query, the last position, attends every key."""
    if not isinstance(mask, mx.array):
        return s
    return mx.where(mask, s, mx.finfo(s.dtype).min) if mask.dtype == mx.bool_ else s + mask


def read_cast(queries: mx.array, q_keys: CastIntegers, q_values: CastIntegers, scale: float, mask, group: int,
              bits: int) -> mx.array:
    """Queries [B, heads, 1, dim] over keys and values read cast: [B, heads, 1, dim]."""
    b, heads, _, dim = queries.shape
    kv = q_keys[0].shape[-3]
    s = masked(scores((queries * scale).reshape(b, kv, heads // kv, dim), q_keys, bits, group).reshape(b, heads, 1, -1),
               mask)
    w = mx.softmax(s, axis=-1, precise=True).reshape(b, kv, heads // kv, -1)
    return weighted(w, q_values, bits, group).reshape(b, heads, 1, -1)


def heads_of(rows: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Rows [B, kv, t, width] as kv_reading.c reads them: (rows, head stride, row stride in bytes), the batch and
    its key heads one run of B * kv heads where their strides allow (a cache's slice), else a copy that does."""
    if rows.strides[0] != rows.shape[1] * rows.strides[1] or rows.strides[-1] != rows.itemsize:
        rows = np.ascontiguousarray(rows)
    return rows, rows.strides[1], rows.strides[2]


def read_in_place(queries: mx.array, q_keys: StoredRows, q_values: StoredRows, scale: float, mask, group: int,
                  bits: int) -> mx.array:
    """Queries [B, heads, 1, dim] over stored keys and values read by kv_reading.c: [B, heads, 1, dim_v]."""
    (keys, dim, library), (values, value_dim, _) = q_keys, q_values
    queries = queries.astype(mx.float32)
    additive = masked(mx.zeros((1, 1, 1, keys.shape[2]), mx.float32), mask)  # 0 where a key is attended
    mx.eval(queries, keys, values, additive)
    b, heads = queries.shape[:2]
    (k, k_head, k_row), (v, v_head, v_row) = heads_of(np.asarray(keys)), heads_of(np.asarray(values))
    kv, t = k.shape[1], k.shape[2]
    n = heads // kv
    q = np.ascontiguousarray(np.asarray(queries).reshape(b * kv, n, dim) * np.float32(scale))
    s = np.empty((b, heads, 1, t), np.float32)
    library.scores(q.ctypes.data, n * dim, dim, b * kv, n, dim, k.ctypes.data, k_head, k_row, t, bits, group,
                   HALF_STEP, BIAS_FIRST, s.ctypes.data, n * t, t, THREADS)
    s += np.asarray(additive)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    blocks = np.empty((b * kv, -(-t // BLOCK_TOKENS), n, value_dim), np.float32)
    library.block_sums(s.ctypes.data, n * t, t, b * kv, n, value_dim, v.ctypes.data, v_head, v_row, t, bits, group,
                       HALF_STEP, BIAS_FIRST, BLOCK_TOKENS, blocks.ctypes.data, None, THREADS)
    return mx.array(blocks.sum(axis=1).reshape(b, heads, 1, value_dim))


def visible(mask, rows: int, n: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Under mlx-lm's `mask` for `n` queries a row over `t` keys: each row's first key [rows] and each query's last
    [rows, n]. A mask array is boolean ([rows or 1, 1, n, t]: a decode batch's left padding, then causal); a row's
    last query sees all of its keys."""
    if mask is None or isinstance(mask, str):  # none: one query, every key; "causal": the last n keys are the queries'
        return np.zeros(rows, np.int64), np.broadcast_to(np.arange(t - n, t), (rows, n))
    if mask.dtype != mx.bool_:
        raise ValueError("an ordered reading takes mlx-lm's boolean masks")
    seen = np.broadcast_to(np.asarray(mask), (rows, 1, n, t))[:, 0]
    return seen[:, -1].argmax(-1), t - 1 - seen[..., ::-1].argmax(-1)


def halved(x: np.ndarray, axis: int) -> np.ndarray:
    """x summed over `axis` by halves: zero-padded to a power of two, then each half added to the other until one
    is left. Which terms meet is set by their places alone, and zeros after the last add nothing, so a sum is the
    same bits at any length (the torch backend's `ordered_attention.halved`, and kv_reading.c's `halved_sum`)."""
    count = x.shape[axis]
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, (1 << (count - 1).bit_length()) - count)
    x = np.pad(x, widths)
    while x.shape[axis] > 1:
        first, second = np.split(x, 2, axis=axis)
        x = first + second
    return x.squeeze(axis)


def read_ordered(queries: mx.array, q_keys: OrderedRows, q_values: OrderedRows, scale: float, mask, group: int,
                 bits: int) -> mx.array:
    """Queries [B, heads, n, dim] over stored keys and values read by kv_reading.c in one order whatever the pass:
    [B, heads, n, dim_v]. A row's keys are read from its first (a decode batch's left padding skipped), so its
    blocks of BLOCK_TOKENS start where its positions do; the kernel's score of a key and its sum of a block's
    weighted values are one order of operations whatever queries and keys a call gives it; a key after a query's
    position weighs exactly zero, adding nothing; and the blocks' sums and sums of weights are `halved`. So a query
    gets the same bits in a prefill chunk of any length, a verify row, a decode row and any batch."""
    (keys, dim, library), (values, value_dim, _) = q_keys, q_values
    queries = queries.astype(mx.float32)
    mx.eval(queries, keys, values)
    b, heads, n, _ = queries.shape
    kv, t = keys.shape[1], keys.shape[2]
    group_heads = heads // kv
    first, last = visible(mask, b, n, t)
    # column c of a row's [kv, n * group_heads, dim]: query c // group_heads of one of the kv head's query heads
    columns = (np.asarray(queries).reshape(b, kv, group_heads, n, dim).transpose(0, 1, 3, 2, 4)
               .reshape(b, kv, n * group_heads, dim) * np.float32(scale))
    out = np.empty((b, kv, n * group_heads, value_dim), np.float32)
    stored = np.asarray(keys), np.asarray(values)  # views of MLX's buffers
    for row in range(b):
        start, end = int(first[row]), int(last[row].max()) + 1
        (k, k_head, k_row), (v, v_head, v_row) = (heads_of(rows[row:row + 1, :, start:end]) for rows in stored)
        ends = np.repeat(last[row] - start, group_heads)  # each column's last key in the row's keys
        q = np.ascontiguousarray(columns[row])
        span = end - start
        at_once = max(1, min(n * group_heads, SCORE_BYTES // (4 * kv * span)))
        for c0 in range(0, n * group_heads, at_once):
            c = min(at_once, n * group_heads - c0)
            s = np.empty((kv, c, span), np.float32)
            library.scores(q[:, c0:].ctypes.data, n * group_heads * dim, dim, kv, c, dim, k.ctypes.data, k_head,
                           k_row, span, bits, group, HALF_STEP, BIAS_FIRST, s.ctypes.data, c * span, span, THREADS)
            s[:, np.arange(span)[None] > ends[c0:c0 + c, None]] = -np.inf
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            blocks = -(-span // BLOCK_TOKENS)
            sums = np.empty((kv, blocks, c, value_dim), np.float32)
            weights = np.empty((kv, blocks, c), np.float32)
            library.block_sums(s.ctypes.data, c * span, span, kv, c, value_dim, v.ctypes.data, v_head, v_row, span,
                               bits, group, HALF_STEP, BIAS_FIRST, BLOCK_TOKENS, sums.ctypes.data,
                               weights.ctypes.data, THREADS)
            out[row, :, c0:c0 + c] = halved(sums, 1) / halved(weights, 1)[..., None]
    ordered = out.reshape(b, kv, n, group_heads, value_dim).transpose(0, 1, 3, 2, 4).reshape(b, heads, n, value_dim)
    return mx.array(ordered)


def attention(queries: mx.array, q_keys, q_values, scale: float, mask, group_size: int = 64, bits: int = 8) -> mx.array:
    """mlx-lm's `quantized_scaled_dot_product_attention`, reading `OrderedRows` in any pass, and `StoredRows` and
    `CastIntegers` of one query a row, as they say; anything else through mlx-lm's."""
    if isinstance(q_keys, OrderedRows):
        return read_ordered(queries, q_keys, q_values, scale, mask, group_size, bits).astype(queries.dtype)
    one_query = queries.shape[2] == 1
    if one_query and isinstance(q_keys, StoredRows):
        return read_in_place(queries, q_keys, q_values, scale, mask, group_size, bits).astype(queries.dtype)
    if one_query and isinstance(q_keys, CastIntegers):
        return read_cast(queries, q_keys, q_values, scale, mask, group_size, bits)
    return MLX_LM_ATTENTION(queries, q_keys, q_values, scale, mask, group_size, bits)


def install() -> None:
    """mlx-lm's attention reads `StoredRows` and `CastIntegers` through `attention` from now on (the MLX backend's
    load calls it)."""
    base.quantized_scaled_dot_product_attention = attention
