"""Where a step's time goes, and decode/prefill speed next to the weights-read floor.

    python -m kvfork.tools.decode_bench --model FOLDER [--trees .,/tmp/old] [--kv-cache-dtypes auto,int8,int4]
        [--profile] [--layout]

- floor: the model's weight bytes (its safetensors files) over this machine's
  measured read bandwidth (a sum over a buffer far larger than the caches, with
  the backend's thread count): no decode step can beat it.
- decode: ITL p50 (ms per step, logits on the host) for each session count at
  each context length. The sessions are one prefilled prompt and clones of it
  at slightly shorter lengths, so setting them up costs one prefill.
- prefill: tok/s of one `--prompt`-token prompt alone and of `--concurrent`
  prompts arriving together, chunked as the engine's scheduler does
  (`--chunk` tokens per request, every prefilling request in every step).
- `--trees A,B`: the same measurements for each source tree (say, a checkout of
  an older commit), side by side in one run: each tree runs in its own worker
  process, one at a time, in alternating order. This file is copied into a tree
  that lacks it; it uses only the backend interface.
- `--kv-cache-dtypes auto,int8,int4`: the same for each KV storage, one worker per
  tree and storage, side by side in the same alternating order.
- `--profile` (torch): the operators' share of decode steps, from torch.profiler.
- `--layout` (torch CPU): decode attention over the KV layouts one could choose,
  30 layers x `--sessions` sessions at 2,048 tokens: token-major vs head-major
  buffers, one SDPA per row vs a padded batch (stacking the rows' KV), and a
  pool of blocks gathered per row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, min(vocab, 30000), n).tolist()


def weight_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def read_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes per second of a read-only pass (a sum) over `gib` GiB of float32, best of `repeat`."""
    import torch

    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeat))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- the worker: one tree, one backend, commands on stdin -------------------------------------


class Worker:
    def __init__(self, backend: str, model: str, kv_cache_dtype: str):
        from kvfork.backends import create_backend
        from kvfork.backends.base import KVStorage

        self.b = create_backend(backend)
        if kv_cache_dtype != "auto":
            self.b.set_kv_storage(KVStorage.named(kv_cache_dtype))
        self.b.load(model)

    def decode(self, context: int, sessions: list[int], steps: int) -> dict:
        """ITL p50 (ms) for each session count, at `context` tokens (session i at context - 8i)."""
        b, vocab = self.b, self.b.info.vocab_size
        donor = b.open_session()
        tokens = prompt(context, vocab)
        for at in range(0, context, 2048):
            b.to_numpy(b.prefill([donor], [tokens[at : at + 2048]]))
        opened = [donor] + [b.clone(donor, context - 8 * i) for i in range(1, max(sessions))]
        out = {}
        for n in sessions:
            batch, ids = opened[:n], [101 + i for i in range(n)]
            b.to_numpy(b.decode(batch, ids))  # warm-up
            times = [_timed(lambda: b.to_numpy(b.decode(batch, ids))) for _ in range(steps)]
            out[n] = round(statistics.median(times) * 1e3, 1)
        for s in opened:
            b.release(s)
        return out

    def prefill(self, length: int, concurrent: int, chunk: int) -> float:
        """tok/s of `concurrent` prompts of `length` tokens, each step one chunk of each."""
        b = self.b
        prompts = [prompt(length, b.info.vocab_size, seed=i) for i in range(concurrent)]
        sessions = [b.open_session() for _ in prompts]
        start = time.perf_counter()
        for at in range(0, length, chunk):
            b.to_numpy(b.prefill(sessions, [p[at : at + chunk] for p in prompts]))
        seconds = time.perf_counter() - start
        for s in sessions:
            b.release(s)
        return round(concurrent * length / seconds, 1)

    def profile(self, context: int, sessions: int, steps: int) -> dict:
        import torch

        b = self.b
        donor = b.open_session()
        tokens = prompt(context, b.info.vocab_size)
        for at in range(0, context, 2048):
            b.prefill([donor], [tokens[at : at + 2048]])
        opened = [donor] + [b.clone(donor, context - 8 * i) for i in range(1, sessions)]
        ids = [101 + i for i in range(sessions)]
        b.decode(opened, ids)
        with torch.profiler.profile() as prof:
            for _ in range(steps):
                b.to_numpy(b.decode(opened, ids))
        for s in opened:
            b.release(s)
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in rows)
        return {e.key: f"{e.self_cpu_time_total / total:.1%}" for e in rows[:8]}

    def serve(self) -> None:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            command = json.loads(line)
            result = getattr(self, command.pop("call"))(**command)
            print(json.dumps(result), flush=True)


class Tree:
    """A worker process running this tool from another source tree."""

    def __init__(self, root: Path, backend: str, model: str, kv_cache_dtype: str, name: str):
        tool = root / "tools" / HERE.name
        if not tool.exists():
            shutil.copy(HERE, tool)
        self.root, self.name = root, name
        command = [sys.executable, "-m", f"kvfork.tools.{HERE.stem}", "--serve", "--backend", backend, "--model", model,
                   "--kv-cache-dtypes", kv_cache_dtype]
        self.proc = subprocess.Popen(command, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(root)})
        self._read()

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker in {self.root} stopped")
        return json.loads(line)

    def __call__(self, call: str, **kwargs):
        self.proc.stdin.write(json.dumps({"call": call, **kwargs}) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        print(f"{self.name} {call} {kwargs}: {json.dumps(result)}", file=sys.stderr, flush=True)  # progress
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


# ---- layout: attention over the KV layouts one could choose (torch CPU) ----------------------


def layout(sessions: int, context: int = 2048, layers: int = 30, kv_heads: int = 3, heads: int = 9,
           head_dim: int = 64, block: int = 256, repeat: int = 5) -> dict:
    import torch
    import torch.nn.functional as F

    cap = (context // block + 1) * block
    lengths = [context - 8 * i for i in range(sessions)]
    q = torch.randn(1, heads, 1, head_dim)

    def buffers(shape):
        return [[(torch.randn(shape), torch.randn(shape)) for _ in range(layers)] for _ in range(sessions)]

    token_major, head_major = buffers((cap, kv_heads, head_dim)), buffers((kv_heads, cap, head_dim))
    pool = [(torch.randn(sessions * cap // block, kv_heads, block, head_dim),) * 2 for _ in range(layers)]

    def sdpa(k, v):
        return F.scaled_dot_product_attention(q, k[None], v[None], enable_gqa=True)

    def per_row_token_major():
        for s, n in enumerate(lengths):
            for k, v in token_major[s]:
                sdpa(k[:n].transpose(0, 1), v[:n].transpose(0, 1))

    def per_row_head_major():
        for s, n in enumerate(lengths):
            for k, v in head_major[s]:
                sdpa(k[:, :n], v[:, :n])

    longest = max(lengths)
    pad = (torch.arange(longest)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]
    qs = q.expand(sessions, -1, -1, -1)

    def padded_head_major():
        for layer in range(layers):
            k = torch.stack([head_major[s][layer][0][:, :longest] for s in range(sessions)])
            v = torch.stack([head_major[s][layer][1][:, :longest] for s in range(sessions)])
            F.scaled_dot_product_attention(qs, k, v, attn_mask=pad, enable_gqa=True)

    def pool_gathered():
        for s, n in enumerate(lengths):
            table = torch.arange(s * cap // block, s * cap // block + -(-n // block))
            for k, v in pool:
                keys = k[table].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n]
                values = v[table].transpose(0, 1).reshape(kv_heads, -1, head_dim)[:, :n]
                sdpa(keys, values)

    variants = {"per_row_token_major": per_row_token_major, "per_row_head_major": per_row_head_major,
                "padded_head_major": padded_head_major, "pool_gathered": pool_gathered}
    best = {name: float("inf") for name in variants}
    for _ in range(repeat):  # round-robin, so a busy moment hits every variant alike
        for name, fn in variants.items():
            best[name] = min(best[name], _timed(fn))
    kv_mb = sum(lengths) * layers * 2 * kv_heads * head_dim * 4 / 1e6
    return {"kv_read_mb": round(kv_mb), **{f"{name}_ms": round(t * 1e3, 1) for name, t in best.items()}}


# ---- the parent ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="torch", choices=["mlx", "torch", "auto"])
    parser.add_argument("--model", required=True, help="a Hugging Face style model folder")
    parser.add_argument("--trees", default=".", help="source trees to compare, comma separated")
    parser.add_argument("--kv-cache-dtypes", default="auto", help="KV storages to compare, comma separated")
    parser.add_argument("--contexts", default="256,2048,8000")
    parser.add_argument("--sessions", default="1,4,8")
    parser.add_argument("--steps", type=int, default=12, help="decode steps per figure (median)")
    parser.add_argument("--prompt", type=int, default=2048, help="prefill prompt length")
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per request per step")
    parser.add_argument("--profile", action="store_true", help="torch: operators' share of decode at 4 x 2,048")
    parser.add_argument("--layout", action="store_true", help="torch CPU: attention over candidate KV layouts")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        Worker(args.backend, args.model, args.kv_cache_dtypes).serve()
        return

    model = str(Path(args.model).expanduser().resolve())
    sessions = [int(n) for n in args.sessions.split(",")]
    wbytes, bandwidth = weight_bytes(Path(model)), read_bandwidth()
    report: dict = {"weight_mb": round(wbytes / 1e6), "read_gb_s": round(bandwidth / 1e9, 1),
                    "floor_ms": round(wbytes / bandwidth * 1e3, 1)}
    if args.layout:
        report["layout_4x2048"] = layout(max(sessions))
    roots, dtypes = [Path(t).resolve() for t in args.trees.split(",")], args.kv_cache_dtypes.split(",")
    trees = [Tree(root, args.backend, model, dtype, str(root) if len(dtypes) == 1 else f"{root} kv={dtype}")
             for root in roots for dtype in dtypes]
    results: dict = {tree.name: {} for tree in trees}
    for turn, context in enumerate(int(c) for c in args.contexts.split(",")):
        for tree in trees[:: 1 if turn % 2 == 0 else -1]:
            results[tree.name][f"decode_itl_p50_ms_at_{context}"] = tree("decode", context=context,
                                                                             sessions=sessions, steps=args.steps)
    for turn, n in enumerate((1, args.concurrent)):
        for tree in trees[:: 1 if turn % 2 == 0 else -1]:
            results[tree.name][f"prefill_{n}x{args.prompt}_tok_s"] = tree("prefill", length=args.prompt,
                                                                              concurrent=n, chunk=args.chunk)
    if args.profile:
        for tree in trees:
            results[tree.name]["profile_4x2048"] = tree("profile", context=2048, sessions=4, steps=4)
    for tree in trees:
        tree.close()
    report["trees"] = results
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
