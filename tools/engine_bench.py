"""Engine figures, measured in process on one backend, side by side in one run:

1. decode throughput (generated tokens/s over all requests) with 1, 4 and 8
   requests decoding together;
2. the engine's own overhead per runner step: step time outside the backend
   calls, as a share of the step time, from the runner's step counters; and
   the control loop's time on runner events per step (another thread);
3. with --burst N: N requests sent at once that share a prompt prefix, with
   reuse off, with clone-now (--no-follow) and with following: TTFT,
   prompt tokens prefilled, and wall time;
4. with --choices N: one request with n = N choices against N separate
   requests sent at once (reuse off), all on one prompt of --shared tokens:
   time to every choice's first token, and prompt tokens prefilled;
5. with --interference N: N requests decoding while a --long prompt prefills,
   once per --step-ms value (--max-step-ms): the decoders' inter-token latency
   p50/p95 over the prefill, and the long prompt's TTFT.

    python -m kvfork.tools.engine_bench [--model FOLDER] [--backend mlx] [--tokens 64] [--burst 6]
    python -m kvfork.tools.engine_bench --backend torch --choices 4 --shared 1500 --repeat 3
    python -m kvfork.tools.engine_bench --backend torch --interference 4 --long 4000 --step-ms 0,250

Prompts are distinct and the prefix cache is off, so every request prefills
and decodes in full. Decode is timed from the moment every request has its
first token to the moment the last one ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from kvfork.backends import create_backend
from kvfork.backends.base import SamplingParams
from kvfork.backends.default_model import default_model_dir
from kvfork.server.engine.api import GenerateRequest, TokenEvent
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.watch.metrics import Registry
from kvfork.tools.bench.stats import percentile


async def decode_round(engine: Engine, concurrent: int, prompt_len: int, tokens: int, seed: int) -> dict:
    prompts = [[(seed * 7919 + i * 104729 + j * 31) % 30000 + 100 for j in range(prompt_len)]
               for i in range(concurrent)]
    handles = [engine.submit(GenerateRequest(f"b{seed}-{i}", p, SamplingParams(), tokens, ignore_eos=True))
               for i, p in enumerate(prompts)]
    first: list[float] = []
    counts = [0] * concurrent
    stamps: list[list[float]] = [[] for _ in range(concurrent)]

    async def read(i: int) -> None:
        async for event in handles[i]:
            if isinstance(event, TokenEvent):
                counts[i] += 1
                stamps[i].append(time.perf_counter())
                if counts[i] == 1:
                    first.append(stamps[i][-1])

    m = engine.metrics
    await asyncio.gather(*(read(i) for i in range(concurrent)))
    start, end = max(first), max(s[-1] for s in stamps)
    decoded = sum(sum(1 for t in s if t > start) for s in stamps)
    return {"concurrent": concurrent, "decode_tokens": decoded, "decode_s": round(end - start, 4),
            "decode_tps": round(decoded / (end - start), 1), "steps": m.steps.get()}


async def burst_round(args: argparse.Namespace, mode: str) -> dict:
    """`--burst` requests at once: a shared prefix of `--shared` tokens, then a distinct tail of 8."""
    reuse = {"off": dict(active_prefix_reuse_min_tokens=0), "clone-now": dict(active_prefix_reuse_min_tokens=1, follow=False),
             "follow": dict(active_prefix_reuse_min_tokens=1)}[mode]
    config = EngineConfig(prefix_cache_entries=0, kv_budget_bytes=8 << 30, **reuse)
    engine = Engine(create_backend(args.backend), args.model, args.dtype, config, Registry())
    await engine.start()
    await decode_round(engine, 1, 16, 2, seed=99)  # warm-up
    before = engine.metrics.prefilled_tokens.get()
    shared = [(j * 7 + 11) % 30000 + 100 for j in range(args.shared)]
    start = time.perf_counter()
    handles = [engine.submit(GenerateRequest(f"burst-{i}", shared + [200 + i] * 8, SamplingParams(), 8))
               for i in range(args.burst)]
    ttft = []
    for handle in handles:
        async for event in handle:
            if not isinstance(event, TokenEvent):
                ttft.append(event.usage.ttft_s)
    wall = time.perf_counter() - start
    prefilled = engine.metrics.prefilled_tokens.get() - before
    await engine.shutdown(5)
    ttft.sort()
    return {"mode": mode, "requests": args.burst, "shared_tokens": args.shared, "prefilled_tokens": int(prefilled),
            "ttft_p50_s": round(ttft[len(ttft) // 2], 3), "ttft_max_s": round(ttft[-1], 3), "wall_s": round(wall, 3)}


async def choices_round(engine: Engine, args: argparse.Namespace, together: bool, seed: int) -> dict:
    """One prompt, `--choices` answers: as one request's n choices, or as that many requests at once."""
    prompt = [(seed * 104729 + j * 7 + 11) % 30000 + 100 for j in range(args.shared)]
    sampling = SamplingParams(temperature=1.0, seed=seed)
    before = engine.metrics.prefilled_tokens.get()
    start = time.perf_counter()
    if together:
        handles = engine.submit_choices(GenerateRequest(f"n-{seed}", prompt, sampling, 8, n=args.choices))
    else:
        handles = [engine.submit(GenerateRequest(f"sep-{seed}-{i}", prompt, sampling, 8))
                   for i in range(args.choices)]
    firsts: list[float] = []

    async def read(handle) -> None:
        first = None
        async for event in handle:
            if first is None and isinstance(event, TokenEvent):
                first = time.perf_counter()
        assert first is not None, "a choice made no token"
        firsts.append(first)

    await asyncio.gather(*(read(h) for h in handles))
    return {"mode": f"n={args.choices}" if together else f"{args.choices} requests",
            "all_first_tokens_s": round(max(firsts) - start, 4),
            "prefilled_tokens": int(engine.metrics.prefilled_tokens.get() - before)}


async def interference_round(args: argparse.Namespace, max_step_ms: float) -> dict:
    """`--interference` requests decode; then a `--long` prompt arrives: their ITL until its first token."""
    config = EngineConfig(prefix_cache_entries=0, kv_budget_bytes=8 << 30, max_step_ms=max_step_ms)
    engine = Engine(create_backend(args.backend), args.model, args.dtype, config, Registry())
    await engine.start()
    await decode_round(engine, 1, 16, 2, seed=99)  # warm-up
    room = engine.config.max_context - args.prompt
    decoders = [engine.submit(GenerateRequest(f"d{i}", [(i * 31 + j * 7) % 30000 + 100 for j in range(args.prompt)],
                                              SamplingParams(), room, ignore_eos=True))
                for i in range(args.interference)]
    stamps: list[list[float]] = [[] for _ in decoders]
    decoding = asyncio.Event()

    async def read(i: int) -> None:
        async for event in decoders[i]:
            if isinstance(event, TokenEvent):
                stamps[i].append(time.perf_counter())
                if all(len(s) >= 3 for s in stamps):
                    decoding.set()

    readers = [asyncio.create_task(read(i)) for i in range(len(decoders))]
    await decoding.wait()
    long_prompt = [(j * 13 + 5) % 30000 + 100 for j in range(args.long)]
    sent = time.perf_counter()
    handle = engine.submit(GenerateRequest("long", long_prompt, SamplingParams(), 1, ignore_eos=True))
    async for event in handle:
        pass
    first = time.perf_counter()
    for d in decoders:
        d.cancel()
    await asyncio.gather(*readers)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if b > sent and a < first]  # overlapping the prefill
    await engine.shutdown(5)
    row = {"max_step_ms": max_step_ms, "decoders": args.interference, "long_tokens": args.long,
           "long_ttft_s": round(first - sent, 3), "itl_p50_ms": round(1000 * percentile(gaps, 50), 1),
           "itl_p95_ms": round(1000 * percentile(gaps, 95), 1), "itl_max_ms": round(1000 * max(gaps), 1),
           "gaps": len(gaps)}
    print(json.dumps(row), file=sys.stderr, flush=True)  # each round as it ends: a slow run still leaves figures
    return row


async def measure(args: argparse.Namespace) -> dict:
    if args.choices:
        config = EngineConfig(prefix_cache_entries=0, active_prefix_reuse_min_tokens=0, kv_budget_bytes=8 << 30)
        engine = Engine(create_backend(args.backend), args.model, args.dtype, config, Registry())
        await engine.start()
        await decode_round(engine, 1, 16, 2, seed=99)  # warm-up
        rows = [await choices_round(engine, args, together, seed=round_ * 2 + together)
                for round_ in range(args.repeat) for together in (True, False)]
        await engine.shutdown(5)
        return {"model": args.model, "backend": args.backend, "dtype": engine.info.dtype,
                "device": engine.info.device, "prompt_tokens": args.shared, "choices": rows}
    if args.interference:
        return {"model": args.model, "backend": args.backend,
                "interference": [await interference_round(args, float(ms)) for ms in args.step_ms.split(",")]}
    if args.burst:
        return {"model": args.model, "backend": args.backend,
                "burst": [await burst_round(args, mode) for mode in ("off", "clone-now", "follow")]}
    backend = create_backend(args.backend)
    config = EngineConfig(prefix_cache_entries=0, kv_budget_bytes=8 << 30, max_tokens=args.tokens)
    engine = Engine(backend, args.model, args.dtype, config, Registry())
    await engine.start()
    await decode_round(engine, 1, args.prompt, 8, seed=0)  # warm-up: kernels compile
    rows = []
    for round_ in range(args.repeat):
        for concurrent in (1, 4, 8):
            m = engine.metrics
            counters = (m.steps, m.step_seconds, m.backend_seconds, m.control_seconds)
            before = [c.get() for c in counters]
            row = await decode_round(engine, concurrent, args.prompt, args.tokens, seed=1 + round_ * 10 + concurrent)
            steps, step_s, backend_s, control_s = (c.get() - b for c, b in zip(counters, before))
            row.update(steps=int(steps), step_ms=round(1000 * step_s / steps, 3),
                       overhead_us_per_step=round(1e6 * (step_s - backend_s) / steps, 1),
                       overhead_share=round((step_s - backend_s) / step_s, 4),
                       control_loop_us_per_step=round(1e6 * control_s / steps, 1))
            rows.append(row)
    await engine.shutdown(5)
    return {"model": args.model, "backend": args.backend, "dtype": engine.info.dtype, "device": engine.info.device,
            "prompt_tokens": args.prompt, "max_tokens": args.tokens, "rounds": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--backend", default="mlx")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--burst", type=int, default=0, help="measure a burst of this many requests instead")
    parser.add_argument("--shared", type=int, default=512, help="shared prompt tokens in a burst, or the prompt "
                        "of --choices")
    parser.add_argument("--choices", type=int, default=0, help="measure n choices against as many requests instead")
    parser.add_argument("--interference", type=int, default=0,
                        help="measure this many decoders' ITL while a --long prompt prefills instead")
    parser.add_argument("--long", type=int, default=4000, help="the long prompt's tokens (--interference)")
    parser.add_argument("--step-ms", default="0,250", help="--max-step-ms values to compare (--interference)")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(measure(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
