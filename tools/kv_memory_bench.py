"""Resident memory beyond the KV a backend holds, over many clone / grow / decode / release cycles: what the
allocator keeps that no session holds (tools/soak.py's RSS row, isolated from HTTP and the engine).

    python -m kvfork.tools.kv_memory_bench [--backend torch|mlx] [--kv-cache-dtype int8] [--model FOLDER]
        [--cycles 600]

One 1,024-token session is prefilled; then each cycle clones it at a random length, grows half of the clones
by a short chunk, decodes a few steps of up to four of them together, and releases random clones so 4-24 stay
alive. Prints RSS minus the backend's `total_bytes()` after 100 cycles (warm) and at the end, and the growth
between them; then with every session released, and after the runner's idle step gives the heap's free pages
back (`device_memory.give_back_free_heap`).
"""

from __future__ import annotations

import argparse
import random
import time

from kvfork.backends.default_model import default_model_dir
from kvfork.backends.device_memory import give_back_free_heap
from kvfork.tools.memory import rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--cycles", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from kvfork.backends import create_backend
    from kvfork.backends.base import KVStorage

    if args.backend == "torch":
        import torch

        torch.set_num_threads(1)
    backend = create_backend(args.backend)
    backend.set_kv_storage(KVStorage.named(args.kv_cache_dtype))
    backend.load(args.model, "float32" if args.backend == "torch" else None)
    rng = random.Random(args.seed)
    base = backend.open_session()
    for _ in range(4):
        backend.prefill([base], [[rng.randrange(100, 30000) for _ in range(256)]])
    live, warm, t0 = [], 0, time.perf_counter()
    for cycle in range(args.cycles):
        clone = backend.clone(base, rng.randrange(32, 1024))
        if rng.random() < 0.5:
            backend.prefill([clone], [[rng.randrange(100, 30000) for _ in range(rng.randrange(1, 40))]])
        live.append(clone)
        rows = live[-rng.randrange(1, min(4, len(live)) + 1):]
        for _ in range(rng.randrange(1, 4)):
            backend.decode(rows, [rng.randrange(100, 30000) for _ in rows])
        while len(live) > rng.randrange(4, 24):
            backend.release(live.pop(rng.randrange(len(live))))
        if cycle == 100:
            warm = rss_bytes() - backend.total_bytes()
    end = rss_bytes() - backend.total_bytes()
    for session in live + [base]:
        backend.release(session)
    released = rss_bytes() - backend.total_bytes()
    give_back_free_heap()
    given_back = rss_bytes() - backend.total_bytes()
    mib = 2**20
    print(f"{args.backend}, --kv-cache-dtype {args.kv_cache_dtype}: RSS beyond the KV held: {warm / mib:.1f} MiB "
          f"after 100 cycles, {end / mib:.1f} MiB after {args.cycles}: growth {(end - warm) / mib:+.1f} MiB "
          f"({time.perf_counter() - t0:.0f} s); every session released: {released / mib:.1f} MiB; the heap's "
          f"free pages given back: {given_back / mib:.1f} MiB")


if __name__ == "__main__":
    main()
