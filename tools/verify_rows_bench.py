"""Logits rows sampled per step with speculative decoding on: the work row-picked sampling saves.

A verify pass reads k + 1 logits rows for a decode row carrying k drafted tokens, and the walk
(server/engine/worker/speculation.py) samples a row only while the draws before it equal the draft. Each
sampling call picks its rows from the pass's logits (Backend.select_rows); this counts, per call,
the rows the pass gave (`rows_in_pass`: what sampling every row at each draft depth sampled) and
the rows sampled (`rows_sampled`). Work, not seconds: a loaded machine gives the same counts.

    python -m kvfork.tools.verify_rows_bench [--model FOLDER] [--backend torch] [--tokens 128]
                                             [--concurrency 1,4] [--speculative suffix] [--restate 3] [--sends 2]

Workload: per request a prompt that restates one span of 48 random tokens `--restate` times (prompt
lookup finds it where it is restated), sent `--sends` times at each concurrency (suffix decoding
drafts a later send from the earlier replies), greedy, the prefix cache off. A JSON line per
concurrency: steps, tokens, drafted and accepted tokens, and both row counts (in all and per step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any, Sequence

from kvfork.backends import create_backend
from kvfork.backends.base import Backend, SamplingParams
from kvfork.backends.default_model import default_model_dir
from kvfork.server.engine.api import GenerateRequest, TokenEvent
from kvfork.server.engine.config import EngineConfig
from kvfork.server.engine.loop.engine import Engine
from kvfork.server.watch.metrics import Registry


class RowCounts:
    """Counts the rows each sampling call reads from and samples, on `backend` (its methods wrapped)."""

    def __init__(self, backend: Backend):
        self.rows_in_pass = self.rows_sampled = 0
        select_rows = backend.select_rows

        def counted(logits: Any, rows: Sequence[int]) -> Any:
            self.rows_in_pass += len(logits)
            self.rows_sampled += len(rows)
            return select_rows(logits, rows)

        backend.select_rows = counted  # type: ignore[method-assign]


def prompts(n: int, vocab: int, restate: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(3, vocab) for _ in range(48)]
        out.append([rng.randrange(3, vocab) for _ in range(8)] + span * restate)
    return out


async def run_round(engine: Engine, requests: list[list[int]], tokens: int, tag: str) -> int:
    async def one(i: int, prompt: list[int]) -> int:
        handle = engine.submit(GenerateRequest(f"{tag}-{i}", prompt, SamplingParams(), tokens, ignore_eos=True))
        return sum([1 async for event in handle if isinstance(event, TokenEvent)])
    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(requests))))


async def measure(args: argparse.Namespace) -> list[dict]:
    config = EngineConfig(speculative=args.speculative, prefix_cache_entries=0, kv_budget_bytes=4 << 30)
    engine = Engine(create_backend(args.backend), args.model, args.dtype, config, Registry())
    await engine.start()
    counts, m, out = RowCounts(engine.backend), engine.metrics, []
    try:
        assert engine.info is not None
        for concurrency in args.concurrency:
            before = (m.steps.get(), counts.rows_in_pass, counts.rows_sampled,
                      sum(m.spec_drafted.values.values()), sum(m.spec_accepted.values.values()))
            batch = prompts(concurrency, min(engine.info.vocab_size, 30000), args.restate, seed=concurrency)
            generated = 0
            for again in range(args.sends):
                generated += await run_round(engine, batch, args.tokens, f"c{concurrency}-{again}")
            steps, in_pass, sampled, drafted, accepted = (
                now - then for now, then in zip((m.steps.get(), counts.rows_in_pass, counts.rows_sampled,
                                                 sum(m.spec_drafted.values.values()),
                                                 sum(m.spec_accepted.values.values())), before))
            out.append({"concurrency": concurrency, "steps": int(steps), "tokens": generated, "drafted": int(drafted),
                        "accepted": int(accepted), "rows_in_pass": in_pass, "rows_sampled": sampled,
                        "rows_in_pass_per_step": round(in_pass / steps, 2),
                        "rows_sampled_per_step": round(sampled / steps, 2)})
    finally:
        await engine.shutdown(5)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (the default model when left out)")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--speculative", default="suffix", choices=("prompt", "suffix"))
    parser.add_argument("--restate", type=int, default=3, help="times each prompt states its span of tokens")
    parser.add_argument("--sends", type=int, default=2, help="times each prompt is sent at each concurrency")
    args = parser.parse_args(argv)
    args.model = args.model or str(default_model_dir())
    for row in asyncio.run(measure(args)):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
