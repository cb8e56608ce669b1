"""One layer's decode attention on MLX over each storage's keys and values, the cases taken in turn:

    python -m kvfork.tools.mlx_kv_attention_bench [--contexts 2048,8000] [--rows 1,4] [--rounds 21]
        [--heads 9 --kv-heads 3 --head-dim 64] [--group 64]

- `float32`: `mx.fast.scaled_dot_product_attention` over float32 keys and values (`--kv-cache-dtype auto` on
  the CPU);
- `int8`, `int4` stored: the rows the MLX backend stores (backends/mlx/kv_storage.py's `QuantizedRows`, in an
  array a step longer than the context, as mlx-lm's caches grow), read as it reads them on a GPU (`parts`: the
  integers, scales and biases as slices of each row) through mlx-lm's `quantized_scaled_dot_product_attention`;
- `int8`, `int4` separate: the same integers, scales and biases as three contiguous arrays (as mlx-lm's
  `QuantizedKVCache` holds them), through the same function: the stored case without the copy of the slices;
- `int8`, `int4` copy: that copy alone (the slices of keys and values made contiguous);
- `int8`, `int4` dequantized: the stored rows read as the MLX backend reads them at prefill on the CPU
  (`QuantizedRows.dequantized`: the whole layer's keys and values as float32, element by element), then
  `mx.fast.scaled_dot_product_attention` over them;
- `int8`, `int4` mx.dequantize: the same through MLX's `mx.dequantize` kernel;
- `int8`, `int4` in place: the stored rows read as the MLX backend reads them at decode on the CPU, by
  kv_reading.c where they lie (backends/mlx/cpu_attention.py; skipped where it cannot be built);
- `int8`, `int4` cast: its reading without the kernel (the integers cast, the scales and biases applied to scores
  and weights).

The default shape is the default model's (SmolLM2-135M: 9 query heads over 3 KV heads of 64). The cases
alternate their order each round, so a busy moment of a shared machine lands on each alike; prints each
case's median and best time and the median's ratio to float32's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from kvfork.backends import kv_reading
from kvfork.backends.mlx import cpu_attention
from kvfork.backends.mlx.kv_storage import QuantizedRows, Reading

STEP = 256  # mlx-lm's KVCache grows by this many positions


def cases_for(args, context: int, rows: int) -> dict:
    shape = (rows, args.kv_heads, context + STEP, args.head_dim)
    queries = mx.random.normal((rows, args.heads, 1, args.head_dim))
    keys, values = mx.random.normal(shape), mx.random.normal(shape)
    scale = args.head_dim ** -0.5
    live = (..., slice(0, context), slice(None))
    cases = {"float32": lambda: mx.fast.scaled_dot_product_attention(queries, keys[live], values[live],
                                                                     scale=scale, mask=None)}
    held = [queries, keys, values]
    for bits in (8, 4):
        rows_of = QuantizedRows(bits, args.group, mx.float32, integer_attention=True)
        stored = [rows_of.encode(keys), rows_of.encode(values)]
        separate = [tuple(mx.contiguous(a) for a in rows_of.parts(s[live])) for s in stored]
        held += [stored, separate]

        def attention(k, v, bits=bits):
            # a copy of the queries: mlx-lm's function scales its argument in place
            return quantized_scaled_dot_product_attention(mx.array(queries), k, v, scale, None, args.group, bits)

        cases[f"int{bits} stored"] = lambda s=stored, r=rows_of, f=attention: f(r.parts(s[0][live]),
                                                                                 r.parts(s[1][live]))
        cases[f"int{bits} separate"] = lambda s=separate, f=attention: f(*s)
        cases[f"int{bits} dequantized"] = lambda s=stored, r=rows_of: mx.fast.scaled_dot_product_attention(
            queries, *(r.dequantized(side[live]) for side in s), scale=scale, mask=None)
        cases[f"int{bits} mx.dequantize"] = lambda s=stored, r=rows_of: mx.fast.scaled_dot_product_attention(
            queries, *(mx.dequantize(*r.parts(side[live]), group_size=r.group, bits=r.bits, dtype=mx.float32)
                       for side in s), scale=scale, mask=None)
        if kv_reading.library() is not None:
            in_place = QuantizedRows(bits, args.group, mx.float32, integer_attention=False, kernel=kv_reading.library())
            cases[f"int{bits} in place"] = lambda s=stored, r=in_place, bits=bits: cpu_attention.attention(
                queries, *(r.attended(side[live], Reading.IN_PLACE) for side in s), scale, None, args.group, bits)
        cases[f"int{bits} cast"] = lambda s=stored, r=rows_of, bits=bits: cpu_attention.attention(
            queries, *(r.attended(side[live], Reading.CAST) for side in s), scale, None, args.group, bits)
        cases[f"int{bits} copy"] = lambda s=stored, r=rows_of: [mx.contiguous(a) for side in s
                                                                 for a in r.parts(side[live])]
    mx.eval(held)
    return cases


def timed(cases: dict, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, run in (list(cases.items()) if r % 2 == 0 else list(cases.items())[::-1]):
            mx.eval(run())
            start = time.perf_counter()
            mx.eval(run())
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8000")
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--group", type=int, default=64)
    args = parser.parse_args()
    for context in (int(c) for c in args.contexts.split(",")):
        for rows in (int(n) for n in args.rows.split(",")):
            times = timed(cases_for(args, context, rows), args.rounds)
            base = statistics.median(times["float32"])
            for name, ms in times.items():
                print(f"{context} keys, {rows} rows, {name}: p50 {statistics.median(ms):.2f} ms "
                      f"({statistics.median(ms) / base:.2f}x float32), best {min(ms):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
