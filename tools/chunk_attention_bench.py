"""A prefill chunk's attention over long keys on the CPU, two ways side by side in one process:

    python -m kvfork.tools.chunk_attention_bench [--keys 16384,65536,131072] [--chunk 512] [--heads 2 --kv-heads 1
        --head-dim 16] [--threads 1] [--repeat 3]

- masked: torch's scaled_dot_product_attention with a lower-right causal mask over all the keys (the chunk
  is the last `--chunk` of them), as the torch backend ran every chunk before;
- split: backends/torch/attention.py's `chunk_after_keys`, the keys before the chunk unmasked and the
  chunk's own keys causal, each a fused kernel, merged by log-sum-exp.

The default shape is the long tests' model (tests/tiny_models.py, LONG_CONTEXT), where attention is most of
a long prefill. Prints the best of --repeat for each and their ratio."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvfork.backends.torch.attention import chunk_after_keys


def best_of(repeat: int, fn) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="chunk_attention_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="16384,65536,131072", help="comma-separated key counts, the chunk's included")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, scale = args.chunk, args.head_dim ** -0.5
    print(f"{'keys':>8} {'masked ms':>10} {'split ms':>9} {'ratio':>6}")
    for n_keys in (int(k) for k in args.keys.split(",")):
        q = torch.randn(args.heads, n, args.head_dim)
        keys, values = (torch.randn(args.kv_heads, n_keys, args.head_dim) for _ in range(2))
        mask = causal_lower_right(n, n_keys)
        masked = best_of(args.repeat, lambda: F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True))
        split = best_of(args.repeat, lambda: chunk_after_keys(q, keys, values, scale))
        print(f"{n_keys:>8} {masked * 1000:>10.1f} {split * 1000:>9.1f} {masked / split:>5.1f}x")


if __name__ == "__main__":
    main()
