"""Decode ITL at one context length for several --kv-cache-dtype storages, their steps taken in turn.

    python -m kvfork.tools.kv_itl_bench [--backend mlx] [--model FOLDER] [--context 2048] [--rounds 10]
        [--storages auto,int8,int4]

Every storage's backend is loaded in this one process and given a session prefilled with the same
`--context` tokens (chunks of 512) and three clones of it 8, 16 and 24 tokens shorter. Then, round after
round, each storage decodes one step of 1 row and one of 4 rows (the batch formed by an untimed step
first), and prefills 32 tokens on a clone of the session 64 tokens shorter (a returning request's reading of
a cached prefix), the storages in turn and in alternating order, so a busy moment of a shared machine lands
on every storage alike (decode_bench.py measures each source tree's steps in one block instead). Prints the
median ITL (ms, logits on the host) per storage and row count, the median time of that prefill, and how long
each storage's sessions took to prepare.

On MLX, `int8-integers` and `int4-integers` (bench only) are int8 and int4 read as a GPU reads them whatever
the device: attention over the integers (`mx.quantized_matmul`) in every pass (backends/mlx/kv_storage.py,
`attends_integers`); `int8-dequantized` and `int4-dequantized` read the rows dequantized in every pass, decode
too, where the CPU otherwise reads them in place at decode (`QuantizedRows.reading`); `int8-cast` and
`int4-cast` read a decode pass's integers cast, as where kv_reading.c cannot be built. A storage with
`-invariant` (`auto-invariant` on torch, `int8-invariant`) computes batch-invariantly (--batch-invariant), and on torch
`int8-products` and `int4-products` (bench only) read the rows through torch's operations where kv_reading.c would
(decode and prefill: backends/torch/integer_reading.py).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import numpy as np

from kvfork.backends import create_backend
from kvfork.backends.base import KVStorage
from kvfork.backends.default_model import default_model_dir

CHUNK = 512
ROWS = (1, 4)
READINGS = ("-integers", "-dequantized", "-cast")  # bench-only suffixes of an MLX storage's name
INVARIANT = "-invariant"  # a storage computed batch-invariantly
PRODUCTS = "-products"  # a torch storage read through torch's products, not kv_reading.c
SUFFIX = 32  # tokens prefilled after a cached prefix of --context less twice as many


@contextlib.contextmanager
def reading(suffix: str):
    """Quantized storages loaded within read their rows as `suffix` says. MLX: "-integers" as integers in every
    pass, on any device; "-dequantized" dequantized in every pass that would read them in place; "-cast" a
    decode pass's integers cast. torch: "-products" through torch's products."""
    if suffix == PRODUCTS:
        from kvfork.backends.torch import integer_reading

        built = integer_reading.kernel
        integer_reading.kernel = lambda: None  # type: ignore[assignment]
        try:
            yield
        finally:
            integer_reading.kernel = built  # type: ignore[assignment]
        return
    if suffix not in READINGS:
        yield
        return
    from kvfork.backends.mlx import kv_storage

    class Dequantized(kv_storage.QuantizedRows):
        def reading(self, queries, keys, values):
            chosen = super().reading(queries, keys, values)
            return kv_storage.Reading.ROWS if chosen is kv_storage.Reading.IN_PLACE else chosen

    device_choice, rows, kernel = kv_storage.attends_integers, kv_storage.QuantizedRows, kv_storage.in_place_kernel
    if suffix == "-integers":
        kv_storage.attends_integers = lambda: True
    elif suffix == "-cast":
        kv_storage.in_place_kernel = lambda dims: None
    else:
        kv_storage.QuantizedRows = Dequantized  # type: ignore[misc]
    try:
        yield
    finally:
        kv_storage.attends_integers, kv_storage.QuantizedRows = device_choice, rows  # type: ignore[misc]
        kv_storage.in_place_kernel = kernel


def prepared(backend: str, model: str, storage: str, tokens: list[int]):
    b = create_backend(backend)
    name, _, suffix = storage.partition("-")
    b.set_kv_storage(KVStorage.named(name))
    b.set_batch_invariant(f"-{suffix}" == INVARIANT)
    with reading(f"-{suffix}" if suffix else ""):
        b.load(model)
    donor = b.open_session()
    for at in range(0, len(tokens), CHUNK):
        b.to_numpy(b.prefill([donor], [tokens[at:at + CHUNK]]))
    return b, [donor] + [b.clone(donor, len(tokens) - 8 * i) for i in range(1, max(ROWS))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mlx", choices=("mlx", "torch"))
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--storages", default="auto,int8,int4")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(100, 30000, args.context).tolist()
    setups = {}
    for name in args.storages.split(","):
        start = time.perf_counter()
        setups[name] = prepared(args.backend, args.model, name, tokens)
        print(f"{name}: sessions of {args.context} tokens prepared in {time.perf_counter() - start:.1f} s", flush=True)
    times: dict[tuple[str, int], list[float]] = {(name, n): [] for name in setups for n in ROWS}
    suffix: dict[str, list[float]] = {name: [] for name in setups}
    for r in range(args.rounds):
        for n in ROWS:
            for name, (b, sessions) in (list(setups.items()) if r % 2 == 0 else list(setups.items())[::-1]):
                ids = [101 + i for i in range(n)]
                b.to_numpy(b.decode(sessions[:n], ids))
                start = time.perf_counter()
                b.to_numpy(b.decode(sessions[:n], ids))
                times[name, n].append(time.perf_counter() - start)
        for name, (b, sessions) in (list(setups.items()) if r % 2 == 0 else list(setups.items())[::-1]):
            returning = b.clone(sessions[0], args.context - 2 * SUFFIX)
            start = time.perf_counter()
            b.to_numpy(b.prefill([returning], [list(range(200, 200 + SUFFIX))]))
            suffix[name].append(time.perf_counter() - start)
            b.release(returning)
    first = next(iter(setups))
    for (name, n), seconds in times.items():
        p50 = statistics.median(seconds)
        print(f"{name}: {n} rows at {args.context}: ITL p50 {p50 * 1e3:.1f} ms "
              f"({p50 / statistics.median(times[first, n]):.2f}x {first}; of {len(seconds)} steps)")
    for name, seconds in suffix.items():
        p50 = statistics.median(seconds)
        print(f"{name}: {SUFFIX} tokens prefilled after {args.context - 2 * SUFFIX} cached: p50 {p50 * 1e3:.1f} ms "
              f"({p50 / statistics.median(suffix[first]):.2f}x {first}; of {len(seconds)})")


if __name__ == "__main__":
    main()
