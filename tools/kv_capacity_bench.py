"""How many agent prompts the prefix cache keeps under one KV budget, per --kv-cache-dtype, and what
returning to the first one costs, side by side in one run (torch backend, an engine in process).

    python -m kvfork.tools.kv_capacity_bench [--model FOLDER] [--kv-budget-bytes 350MB] [--prompts 8]
        [--tokens 6000] [--dtypes auto,float16,int8,int4] [--queue-timeout 300]

Per storage, a fresh engine under `--kv-budget-bytes` (no disk tier, so an evicted prompt is gone)
is sent `--prompts` distinct agent-shaped prompts of about `--tokens` tokens (instructions then tool
signatures, tools/bench/text.py; distinct from their first token), one after another, one output token
each. Then: how many of them the prefix cache keeps (`cached` entries), and the TTFT of sending the
first prompt again after the others, with the tokens it reused (all but the last on a hit, none on a
miss). `--max-context` is the prompts' length and a little more, so the budget need only hold one
such request, not the model's whole context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from pathlib import Path

from kvfork.backends import create_backend
from kvfork.backends.base import SamplingParams
from kvfork.backends.default_model import default_model_dir
from kvfork.server.settings import parse_size
from kvfork.server.engine.api import GenerateRequest
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.watch.metrics import Registry
from kvfork.tools.bench.text import tool_definitions


def agent_prompts(model: str, count: int, tokens: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    prompts = []
    for seed in range(count):
        ids = tokenizer.encode(tool_definitions(random.Random(seed), tokens + 200)).ids
        prompts.append(ids[:tokens])
    return prompts


async def ask(engine: Engine, name: str, prompt: list[int]):
    handle = engine.submit(GenerateRequest(name, prompt, SamplingParams(), 1))
    async for _ in handle:
        pass
    if handle.done.error:
        raise RuntimeError(handle.done.error)
    return handle.done.usage


async def one_storage(args, dtype: str, prompts: list[list[int]]) -> dict:
    config = EngineConfig(kv_budget_bytes=args.kv_budget_bytes, kv_cache_dtype=dtype, prefix_cache_disk_bytes=0,
                          prefix_cache_entries=len(prompts) + 1, max_context=args.tokens + 64,
                          max_batch_tokens=2048, prefill_chunk=2048, queue_timeout=args.queue_timeout)
    engine = Engine(create_backend("torch"), args.model, None, config, Registry())
    await engine.start()
    try:
        cold = [await ask(engine, f"p{i}", p) for i, p in enumerate(prompts)]
        for _ in range(100):  # the last prompt's capture lands in the cache just after its answer
            if engine.stats().captures_in_use == 0:
                break
            await asyncio.sleep(0.05)
        kept = engine.stats().cached
        back = await ask(engine, "back", prompts[0])
        info = engine.info
        assert info is not None
        return {"storage": info.kv_dtype, "prompt_tokens": min(len(p) for p in prompts), "bytes_per_token": info.kv.full_bytes_per_token,
                "bytes_per_prompt": info.kv.bytes_for(args.tokens), "kept": kept, "of": len(prompts),
                "cold_ttft_s_p50": sorted(u.ttft_s for u in cold)[len(cold) // 2],
                "return_ttft_s": round(back.ttft_s, 3), "return_reused": back.reused_tokens}
    finally:
        await engine.shutdown(5.0)


async def main_async(args) -> None:
    prompts = agent_prompts(args.model, args.prompts, args.tokens)
    rows = []
    for dtype in args.dtypes.split(","):
        row = await one_storage(args, dtype, prompts)
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]["kept"] or 1
    print(f"\nunder a KV budget of {args.kv_budget_bytes / 1e6:.0f} MB, {args.prompts} prompts of {args.tokens} tokens")
    print("| storage | bytes/token | MB per prompt | prompts kept | vs first row | TTFT returning to the first (s) "
          "| reused tokens | cold TTFT p50 (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['storage']} | {r['bytes_per_token']:,} | {r['bytes_per_prompt'] / 1e6:.1f} | {r['kept']} of "
              f"{r['of']} | {r['kept'] / base:.1f}x | {r['return_ttft_s']} | {r['return_reused']} | "
              f"{r['cold_ttft_s_p50']:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-budget-bytes", type=parse_size, default=parse_size("350MB"))
    parser.add_argument("--prompts", type=int, default=8, help="distinct prompts sent before returning to the first")
    parser.add_argument("--tokens", type=int, default=6000, help="tokens per prompt")
    parser.add_argument("--dtypes", default="auto,float16,int8,int4", help="--kv-cache-dtype values, comma-separated")
    parser.add_argument("--queue-timeout", type=float, default=EngineConfig.queue_timeout,
                        help="the engine's --queue-timeout (s): raise it where one prefill may take longer (a loaded machine)")
    args = parser.parse_args(argv)
    args.model = args.model or str(default_model_dir())
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
