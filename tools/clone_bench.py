"""Clone by reference against copying clones, side by side in one process (torch backend; the storage
section on either).

    python -m kvfork.tools.clone_bench --model FOLDER [--sections clone,synthetic,peak,fit,itl,prefill,blocks]
        [--sections storage --storages auto,float16,int8,int4 --backend torch|mlx]

- clone: time and own bytes of a clone at 2,048 and 8,000 tokens of one prefilled
  donor, --clone-mode share and copy alternately (best of --repeat).
- synthetic: the same on KV-only sessions of Qwen3-8B's shape (36 full layers, 8 KV
  heads of 128, bf16; no weights), at 2k and 8k.
- peak: peak bytes held while 8 clones of a 4,000-token prompt each write
  --generate more tokens one at a time (the donor kept), share and copy: the
  backend's own block tables (kv.BlockTable) of the default model's shape and of
  Qwen3-8B's, KV only (what is held depends on positions written, not on values).
- fit: how many agents of a 4,000-token prefix, each generating 256, fit in
  --budget-gib: the published cost function (KVCost), for the default model and
  Qwen3-8B's shape.
- itl: decode ITL p50 of 1, 4 and 8 clones of a 4,000-token prompt decoding
  together: blocks read by reference with the shared prefix read once per step for
  the group (cascade), blocks read by reference row by row (blocked), and one
  contiguous copy each (copy: --clone-mode copy's buffers).
- prefill: tok/s of a clone of a 4,000-token prompt prefilling 512 and 2,048 more
  tokens in one chunk, share (its runs joined per chunk) and copy (one run); and the
  join alone (every full layer's runs copied into attention's buffer, as it does for
  a chunk), as a share of the chunk's time.
- blocks: on the synthetic shape, per block size: a clone's time at 8k, and the
  time to grow a session to 8k one decode write at a time (growth copies the
  store it writes whenever a block fills; fewer, larger blocks copy less often).
- storage: per --kv-cache-dtype (`--storages`), on `--backend`'s 4,000-token donor: the bytes
  of a whole copy, a copying clone's time (--clone-mode copy; MLX clones copy), and the disk tier's
  two halves: saving (export_state, then the file's bytes, disk.encode, written)
  and restoring (the file read, disk.decode, import_state; page cache warm).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from kvfork.backends.base import KVStorage
from kvfork.backends.torch import attention, kv
from kvfork.backends.torch.backend import TorchBackend
from kvfork.backends.torch.kv_storage import Plain

GiB = 2**30
QWEN3_8B = dict(full_layers=36, kv_heads=8, head_dim=128, storage=Plain(torch.bfloat16, torch.bfloat16))
MODES = ("share", "copy")
DECODES = {"cascade": ("share", True), "blocked": ("share", False), "copy": ("copy", False)}  # mode, cascade


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(100, min(vocab, 30000), n).tolist()


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


class Bench:
    def __init__(self, model: str, repeat: int):
        self.b = TorchBackend()
        self.b.load(model, "float32")
        self.vocab, self.repeat = self.b.info.vocab_size, repeat
        self._donors: dict[int, object] = {}

    def donor(self, n: int):
        """One prefilled session of n tokens per length, kept for every section."""
        if n not in self._donors:
            s = self.b.open_session()
            text = prompt(n, self.vocab)
            for at in range(0, n, 1024):
                self.b.prefill([s], [text[at:at + 1024]])
            self._donors[n] = s
        return self._donors[n]

    def clones(self, n: int, mode: str, count: int) -> list:
        self.b.clone_mode = mode  # the setting, flipped in place for a side-by-side run
        return [self.b.clone(self.donor(n), n) for _ in range(count)]

    def release(self, sessions) -> None:
        for s in sessions:
            self.b.release(s)

    def clone(self, lengths=(2000, 8000)) -> dict:
        out = {}
        for n in lengths:
            for mode in MODES:
                def once():
                    self.release(self.clones(n, mode, 1))
                seconds = best(once, self.repeat)
                made = self.clones(n, mode, 1)
                out[f"{n} {mode}"] = dict(ms=round(seconds * 1e3, 3), own_bytes=self.b.session_bytes(made[0]))
                self.release(made)
        return out

    def itl(self, n: int = 4000, counts=(1, 4, 8), steps: int = 24) -> dict:
        """Each variant's clones decode one step in turn, round after round (the order rotating), so a
        noisy machine's slow spells fall on all of them alike; the median of each variant's steps."""
        out = {}
        for count in counts:
            made = {mode: self.clones(n, mode, count) for mode in MODES}
            picks = {name: [prompt(1, self.vocab, i)[0] for i in range(count)] for name in DECODES}
            times: dict[str, list[float]] = {name: [] for name in DECODES}
            names = list(DECODES)
            for step in range(steps):
                for name in names[step % 3:] + names[:step % 3]:
                    mode, attention.CASCADE = DECODES[name]
                    t0 = time.perf_counter()
                    logits = self.b.decode(made[mode], picks[name])
                    picks[name] = self.b.to_numpy(logits).argmax(-1).tolist()
                    times[name].append(time.perf_counter() - t0)
            for name in DECODES:
                out[f"{count} {name}"] = round(statistics.median(times[name]) * 1e3, 2)
            for sessions in made.values():
                self.release(sessions)
        attention.CASCADE = True
        return out

    def prefill(self, n: int = 4000, chunks=(512, 2048)) -> dict:
        out = {}
        for chunk in chunks:
            text = prompt(chunk, self.vocab, seed=5)
            for mode in MODES:
                def once():
                    made = self.clones(n, mode, 1)
                    t0 = time.perf_counter()
                    self.b.to_numpy(self.b.prefill(made, [text]))
                    once.seconds = min(getattr(once, "seconds", 1e9), time.perf_counter() - t0)
                    self.release(made)
                for _ in range(self.repeat):
                    once()
                out[f"{chunk} {mode}"] = round(chunk / once.seconds, 1)
                if mode == "share":
                    made = self.clones(n, mode, 1)
                    self.b.prefill(made, [text])
                    table = made[0].table
                    runs = table.runs()
                    query = torch.empty(self.b.cfg.num_heads, 1, self.b.cfg.head_dim, dtype=self.b.dtype)

                    def join():
                        for layer in range(self.b.pool.full_layers):
                            attention.join([(s.keys[layer][:, :end - s.base], s.values[layer][:, :end - s.base])
                                            for s, end in runs], self.b.pool.storage, query)
                    out[f"{chunk} join share of chunk"] = round(best(join, self.repeat) / once.seconds, 4)
                    self.release(made)
        return out


def storage(backend: str, model: str, dtypes: list[str], repeat: int, n: int = 4000) -> dict:
    """Per storage: a copying clone of n tokens and the disk tier's save and restore of them (ms)."""
    import tempfile
    from pathlib import Path

    from kvfork.backends import create_backend
    from kvfork.server.engine.cache import disk

    out = {}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "state.safetensors"
        for dtype in dtypes:
            b = create_backend(backend)
            b.set_kv_storage(KVStorage.named(dtype))
            b.set_clone_mode("copy")
            b.load(model)
            donor, text = b.open_session(), prompt(n, b.info.vocab_size)
            for at in range(0, n, 1024):
                b.to_numpy(b.prefill([donor], [text[at:at + 1024]]))
            copy = best(lambda: b.release(b.clone(donor, n)), repeat)

            def save():
                path.write_bytes(disk.encode(b.export_state(donor), [], "", "bench"))

            def restore():
                b.release(b.import_state(disk.decode(path.read_bytes(), "bench")[0]))
            saved, restored = best(save, repeat), best(restore, repeat)
            out[b.info.kv_dtype] = dict(state_mb=round(path.stat().st_size / 1e6, 1),
                                        clone_copy_ms=round(copy * 1e3, 2), save_ms=round(saved * 1e3, 1),
                                        restore_ms=round(restored * 1e3, 1))
            b.release(donor)
    return out


def synthetic_table(pool: kv.BlockPool, n: int) -> kv.BlockTable:
    table = kv.BlockTable.empty(pool, session=0, tokens=n)
    for t in (*table.own.keys, *table.own.values):
        t.normal_()
    return table


def synthetic(lengths=(2000, 8000), repeat: int = 3) -> dict:
    pool = kv.BlockPool(device="cpu", **QWEN3_8B)
    out = {}
    for n in lengths:
        donor = synthetic_table(pool, n)
        for mode in MODES:
            def once():
                made = donor.clone(1, n, mode)
                once.nbytes = made.owned_bytes()
                made.release()
            seconds = best(once, repeat)
            out[f"{n} {mode}"] = dict(ms=round(seconds * 1e3, 2), own_bytes=once.nbytes)
        donor.release()
    return out


def peak(shapes: dict[str, dict], n: int = 4000, recipients: int = 8, generate: int = 256) -> dict:
    out = {}
    for name, shape in shapes.items():
        for mode in MODES:
            pool = kv.BlockPool(device="cpu", **shape)
            donor = kv.BlockTable.empty(pool, session=0, tokens=n)
            made = [donor.clone(1 + i, n, mode) for i in range(recipients)]
            top = pool.total_bytes()
            for end in range(n + 1, n + generate + 1):
                for table in made:
                    table.reserve(end)
                top = max(top, pool.total_bytes())
            out[f"{name} {mode}"] = dict(peak_bytes=top, donor_bytes=donor.owned_bytes())
    return out


def blocks(sizes=(64, 128, 256), n: int = 8192, repeat: int = 3) -> dict:
    out = {}
    shape = dict(QWEN3_8B, full_layers=4)  # growth and clone per layer scale alike: 4 layers suffice
    saved = kv.BLOCK_TOKENS
    try:
        for size in sizes:
            kv.BLOCK_TOKENS = size
            pool = kv.BlockPool(device="cpu", **shape)
            donor = synthetic_table(pool, n)
            clone_s = best(lambda: donor.clone(1, n - size // 2, "share").release(), repeat)
            donor.release()
            grower = kv.BlockTable.empty(pool, session=2)
            t0 = time.perf_counter()
            for end in range(1, n + 1):
                grower.reserve(end)
            grow_s = time.perf_counter() - t0
            grower.release()
            out[str(size)] = dict(clone_ms=round(clone_s * 1e3, 3), grow_to_8k_ms=round(grow_s * 1e3, 1))
    finally:
        kv.BLOCK_TOKENS = saved
    return out


def fit(bench: Bench | None, budget_gib: float, prefix: int = 4000, generate: int = 256) -> dict:
    from kvfork.backends.base import KVCost

    slot = 2 * QWEN3_8B["kv_heads"] * QWEN3_8B["head_dim"] * 2
    costs = {"qwen3-8b": KVCost(full_bytes_per_token=slot * QWEN3_8B["full_layers"], step=kv.BLOCK_TOKENS, spare=1,
                                shares=True)}
    if bench is not None:
        costs["default"] = bench.b.info.kv
    budget, total, out = int(budget_gib * GiB), prefix + generate, {}
    for name, cost in costs.items():
        first = cost.bytes_for(total)
        shared = cost.bytes_for(total, shared=kv.floor_block(prefix), start=prefix)
        copied = cost.bytes_for(total, start=prefix)
        out[name] = dict(share=1 + (budget - first) // shared, copy=1 + (budget - first) // copied)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--sections", default="clone,synthetic,peak,fit,itl,prefill,blocks")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--generate", type=int, default=256, help="tokens each of the peak section's clones decodes")
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--storages", default="auto,float16,int8,int4",
                    help="the storage section's --kv-cache-dtype values, comma separated")
    ap.add_argument("--backend", default="torch", choices=("torch", "mlx"), help="the storage section's backend")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    needs_model = {"clone", "itl", "prefill", "fit"} & set(sections)
    bench = Bench(args.model, args.repeat) if needs_model else None
    report: dict = {"threads": torch.get_num_threads(), "block_tokens": kv.BLOCK_TOKENS}
    for section in sections:
        t0 = time.perf_counter()
        match section:
            case "clone":
                report[section] = bench.clone()
            case "synthetic":
                report[section] = synthetic(repeat=args.repeat)
            case "peak":
                shapes = {"qwen3-8b": QWEN3_8B}
                if bench is not None:
                    pool = bench.b.pool
                    shapes["default"] = dict(full_layers=pool.full_layers, kv_heads=pool.kv_heads,
                                             head_dim=pool.head_dim, storage=pool.storage)
                report[section] = peak(shapes, generate=args.generate)
            case "fit":
                report[section] = fit(bench, args.budget_gib)
            case "itl":
                report[section] = bench.itl()
            case "prefill":
                report[section] = bench.prefill()
            case "blocks":
                report[section] = blocks(repeat=args.repeat)
            case "storage":
                report[section] = storage(args.backend, args.model, args.storages.split(","), args.repeat)
            case other:
                raise SystemExit(f"unknown section {other!r}")
        print(json.dumps({section: report[section], "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
