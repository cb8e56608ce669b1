"""Backend speed, side by side in one run: prefill and decode tokens/s, and
the time to clone a prompt against the time to prefill it.

    python -m kvfork.tools.backend_bench --backend mlx --model FOLDER

Every timing ends with the logits on the host (`to_numpy`), as the engine
needs them, so lazy (MLX) and asynchronous (CUDA) backends are timed alike.
Each figure is the best of `--repeat` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from kvfork.backends import create_backend


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best(fn, repeat: int) -> float:
    fn()  # warm-up: kernels compile, buffers settle
    return min(timed(fn) for _ in range(repeat))


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, min(vocab, 30000), n).tolist()


def bench_prefill(b, length: int, repeat: int) -> float:
    tokens = prompt(length, b.info.vocab_size)

    def run():
        s = b.open_session()
        b.to_numpy(b.prefill([s], [tokens]))
        b.release(s)

    return length / best(run, repeat)


def bench_decode(b, sessions: int, context: int, steps: int, repeat: int) -> float:
    opened = [b.open_session() for _ in range(sessions)]
    for i, s in enumerate(opened):
        b.prefill([s], [prompt(context + 8 * i, b.info.vocab_size, seed=i)])
    tokens = [101 + i for i in range(sessions)]

    def run():
        for _ in range(steps):
            b.to_numpy(b.decode(opened, tokens))

    rate = sessions * steps / best(run, repeat)
    for s in opened:
        b.release(s)
    return rate


def bench_clone(b, length: int, repeat: int) -> dict:
    """Clone `length` tokens against prefilling them; then the clone's first write
    (a one-token prefill, as a recipient's remaining prompt) against a plain session's."""
    tokens = prompt(length + 1, b.info.vocab_size)
    donor = b.open_session()
    prefill_s = timed(lambda: b.to_numpy(b.prefill([donor], [tokens[:length]])))
    clones = []
    clone_s = best(lambda: clones.append(b.clone(donor, length)), repeat)
    first_write_s = min(timed(lambda c=c: b.to_numpy(b.prefill([c], [tokens[length:]]))) for c in clones)
    plain_write_s = min(timed(lambda c=c: b.to_numpy(b.prefill([c], [tokens[length:]]))) for c in clones)
    for s in clones + [donor]:
        b.release(s)
    return {
        "clone_tokens": length,
        "clone_ms": round(clone_s * 1e3, 2),
        "prefill_ms": round(prefill_s * 1e3, 1),
        "clone_over_prefill": round(clone_s / prefill_s, 5),
        "first_write_after_clone_ms": round(first_write_s * 1e3, 2),
        "next_write_ms": round(plain_write_s * 1e3, 2),
    }


def bench_checkpoints(b, length: int, count: int, repeat: int) -> dict:
    """A `length`-token prefill in one chunk, plain against keeping the recurrent state at `count`
    evenly spaced positions inside it (Backend.keep_at: the chunk runs in count + 1 pieces)."""
    tokens = prompt(length, b.info.vocab_size)
    kept = [length * (i + 1) // (count + 1) for i in range(count)]
    held = {}

    def run(positions):
        s = b.open_session()
        b.keep_at(s, positions)
        b.to_numpy(b.prefill([s], [tokens]))
        held[len(positions)] = b.session_bytes(s)
        b.release(s)

    plain_s = best(lambda: run([]), repeat)
    kept_s = best(lambda: run(kept), repeat)
    return {
        "tokens": length,
        "checkpoints": kept,
        "plain_prefill_ms": round(plain_s * 1e3, 1),
        "checkpointed_prefill_ms": round(kept_s * 1e3, 1),
        "checkpointed_over_plain": round(kept_s / plain_s, 3),
        "bytes_per_checkpoint": (held[count] - held[0]) // count,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="mlx", choices=["mlx", "torch", "auto"])
    parser.add_argument("--model", required=True, help="a Hugging Face style model folder")
    parser.add_argument("--dtype", default=None, help="default: the backend's (float32 on the CPU)")
    parser.add_argument("--prefill", default="512,2048", help="prompt lengths, comma separated")
    parser.add_argument("--decode", default="1,8", help="session counts, comma separated")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--clone", type=int, default=2048, help="clone this many tokens (0: skip)")
    parser.add_argument("--checkpoints", type=int, default=0,
                        help="hybrids: also time a --clone-token prefill keeping this many checkpoints (0: skip)")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args(argv)

    b = create_backend(args.backend)
    load_s = timed(lambda: b.load(args.model, args.dtype))
    report: dict = {
        "backend": args.backend,
        "model": Path(args.model).name,
        "dtype": b.info.dtype,
        "device": b.info.device,
        "load_s": round(load_s, 2),
        "kv_bytes_per_token": b.info.kv.full_bytes_per_token,  # full-attention layers
        "recurrent_bytes": b.info.kv.state_bytes,  # per session, whatever its length (hybrids)
    }
    for n in map(int, filter(None, args.prefill.split(","))):
        report[f"prefill_{n}_tok_s"] = round(bench_prefill(b, n, args.repeat), 1)
    for n in map(int, filter(None, args.decode.split(","))):
        report[f"decode_{n}_sessions_tok_s"] = round(bench_decode(b, n, args.context, args.steps, args.repeat), 1)
    if args.clone:
        report["clone"] = bench_clone(b, args.clone, args.repeat)
    if args.checkpoints:
        report["checkpoints"] = bench_checkpoints(b, args.clone, args.checkpoints, args.repeat)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
