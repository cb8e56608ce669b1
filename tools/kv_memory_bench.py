"""Resident memory beyond the KV a torch backend holds, over many clone / grow / release cycles: what
the allocator keeps that no session holds (tools/soak.py's RSS row, isolated from HTTP and the engine).

    python -m kvfork.tools.kv_memory_bench [--model FOLDER] [--cycles 600]

One 1,024-token session is prefilled; then each cycle clones it at a random length, grows half of
the clones by a short chunk, and releases random clones so 4-24 stay alive. Prints RSS minus the
backend's `total_bytes()` after 100 cycles (warm) and at the end, and the growth between them.
"""

from __future__ import annotations

import argparse
import random
import time

from kvfork.backends.default_model import default_model_dir
from kvfork.tools.memory import rss_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--cycles", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch

    from kvfork.backends import create_backend

    torch.set_num_threads(1)
    backend = create_backend("torch")
    backend.load(args.model, "float32")
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
        while len(live) > rng.randrange(4, 24):
            backend.release(live.pop(rng.randrange(len(live))))
        if cycle == 100:
            warm = rss_bytes() - backend.total_bytes()
    end = rss_bytes() - backend.total_bytes()
    mib = 2**20
    print(f"RSS beyond the KV held: {warm / mib:.1f} MiB after 100 cycles, {end / mib:.1f} MiB after "
          f"{args.cycles}: growth {(end - warm) / mib:+.1f} MiB ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
