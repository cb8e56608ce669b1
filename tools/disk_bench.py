"""The prefix cache's disk tier after a restart, in process, side by side in one run:
for each prompt size, TTFT when the cached prompt is restored from disk against recomputed,
and what the cost model chooses, on a cold read.

    python -m kvfork.tools.disk_bench [--model FOLDER] [--backend torch] [--sizes 2000,4000,8000]

Per size: daemon 1 computes the prompt and shuts down (its cache spills to a temporary
KVFORK_HOME); then three fresh engines, each after a short unrelated warm-up prompt (so the
prefill rate is measured, as in a daemon that has served a little): disk tier off (recompute),
disk tier on with the cost model as is (its choice), disk tier on with the restore forced. The
page cache is dropped before each restore (/proc/sys/vm/drop_caches where allowed, else
posix_fadvise DONTNEED on the files), so the read is a cold one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from kvfork.backends import create_backend
from kvfork.backends.base import SamplingParams
from kvfork.backends.default_model import default_model_dir
from kvfork.server.engine.api import GenerateRequest
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.engine.policy import placement
from kvfork.server.watch.metrics import Registry


def drop_page_cache(folder: Path) -> str:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "drop_caches"
    except OSError:
        for path in folder.rglob("*.safetensors"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


async def one(args, kv_dir: Path, prompt: list[int], disk: bool, warmup: list[int]) -> dict:
    config = EngineConfig(kv_budget_bytes=8 << 30, max_batch_tokens=2048, prefill_chunk=2048,
                          prefix_cache_disk_bytes=(16 << 30) if disk else 0)
    engine = Engine(create_backend(args.backend), args.model, args.dtype, config, Registry(), kv_dir=kv_dir)
    await engine.start()
    try:
        if warmup:
            await drain(engine.submit(GenerateRequest("warmup", warmup, SamplingParams(), 1)))
        decisions: dict = {}
        handle = engine.submit(GenerateRequest("measured", prompt, SamplingParams(), 1))
        request = next(r for r in engine.requests() if r.req.request_id == "measured")
        decisions = request.decision
        done = await drain(handle)
        if done.error:
            raise RuntimeError(done.error)
        return {"ttft_s": round(done.usage.ttft_s, 3), "reused": done.usage.reused_tokens,
                "source": done.usage.reuse_source, "decision": decisions.get("disk"),
                "expected_restore_s": decisions.get("disk_restore_s"),
                "expected_recompute_s": decisions.get("disk_recompute_s"),
                "prefill_tps": round(engine.rates.rates.prefill_tps),
                "read_MBps": round(engine.rates.rates.read_bps / 1e6)}
    finally:
        await engine.shutdown(5.0)


async def drain(handle):
    async for _ in handle:
        pass
    return handle.done


async def main_async(args) -> None:
    rows = []
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    span = min(40000, vocab - 100)  # ids past the special tokens, inside the vocabulary
    for size in [int(s) for s in args.sizes.split(",")]:
        prompt = [(i * 7919 + size) % span + 100 for i in range(size)]
        warmup = [(i * 104729) % span + 100 for i in range(512)]
        with tempfile.TemporaryDirectory() as home:
            kv_dir = Path(home) / "kv"
            await one(args, kv_dir, prompt, True, [])  # computes it, spills it at shutdown
            file_bytes = sum(p.stat().st_size for p in kv_dir.rglob("*.safetensors"))
            recompute = await one(args, kv_dir, prompt, False, warmup)
            how = drop_page_cache(kv_dir)
            chosen = await one(args, kv_dir, prompt, True, warmup)
            real = placement.choose_restore
            placement.choose_restore = lambda *a: replace(real(*a), restore=True, reason="restore")  # forced
            try:
                drop_page_cache(kv_dir)
                forced = await one(args, kv_dir, prompt, True, warmup)
            finally:
                placement.choose_restore = real
        row = {"tokens": size, "file_MB": round(file_bytes / 1e6, 1), "page_cache": how,
               "recompute": recompute, "cost_model": chosen, "restore_forced": forced}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| tokens | file MB | recompute TTFT s | restore TTFT s (cold) | cost model chose | its TTFT s |")
    print("|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['file_MB']} | {r['recompute']['ttft_s']} | {r['restore_forced']['ttft_s']} | "
              f"{r['cost_model']['decision']} (expected {r['cost_model']['expected_restore_s']} s vs "
              f"{r['cost_model']['expected_recompute_s']} s) | {r['cost_model']['ttft_s']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--sizes", default="2000,4000,8000")
    args = parser.parse_args(argv)
    args.model = args.model or str(default_model_dir())
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
