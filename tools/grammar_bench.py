"""llguidance against xgrammar on one tokenizer: mask time per token and compile time.

    .venv/bin/python -m kvfork.tools.grammar_bench [--model FOLDER] [--repeats 5]

For each engine, on the same tokenizer (the default model's unless --model):
- compile time of each schema (no cache: every compile is cold), alone and with
  the first mask (llguidance builds its lexer lazily, on the first mask): the agent
  preset's tool schemas (tools/bench/workload.py names its tools
  `tool_i(path: str, query: str)`), one compiled as a `tool_choice: required`
  union over all of them, and a typical tool schema (nested, enums, arrays);
- the next-token mask time along a valid document, token by token (median and
  p95): under the typical tool schema and under json_object (any JSON object).
The document is tokenized once by the model's tokenizer and fed to both engines.

    .venv/bin/python -m kvfork.tools.grammar_bench --itl [--backend torch] [--rounds 3]

    .venv/bin/python -m kvfork.tools.grammar_bench --guard [--repeats 5]

kvfork's compile path (server/generate/grammar.py) against building the matcher in the
daemon alone, side by side, each compile cold (a new scope): what trying each new
grammar first in the killable process costs, for the typical tool schema and the
agent preset's union; then a schema of 3,000 optional properties under a 0.5 s
timeout: when its 400 comes, and the CPU this process spends in the 2 s after.

Decode ITL in the engine with 8 requests decoding together, 0, 1 and 8 of them
constrained by the typical tool schema (kvfork's llguidance path), in
alternating rounds side by side. Each request asks for that JSON; the gaps
between consecutive tokens are counted only while all 8 rows are in the batch,
and split into constrained and unconstrained rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any, Callable

TYPICAL_TOOL = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Paris, France"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include": {"type": "array", "items": {"type": "string", "enum": ["wind", "rain", "uv", "humidity"]}},
        "detail": {"type": "object", "properties": {"hourly": {"type": "boolean"}, "lang": {"type": "string"}},
                   "required": ["hourly"], "additionalProperties": False},
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}
TYPICAL_DOC = {"location": "Paris, France", "unit": "celsius", "days": 5, "include": ["wind", "rain"],
               "detail": {"hourly": True, "lang": "fr"}}
OBJECT_DOC = {"files": ["src/main.py", "README.md"], "summary": "Two files changed; tests pass.", "ok": True,
              "count": 2, "meta": {"author": "agent", "score": 0.93}}


def agent_tool_schemas() -> list[dict[str, Any]]:
    """The agent preset's tools, as JSON schemas of their `(path: str, query: str)` signatures."""
    from kvfork.tools.bench.text import tool_definitions
    from kvfork.tools.bench.workload import Options

    names = [line[2:].split("(")[0] for line in tool_definitions(random.Random(0), Options().prefix_tokens).splitlines()
             if line.startswith("- tool_")]
    params = {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}},
              "required": ["path", "query"], "additionalProperties": False}
    return [{"name": name, "parameters": params} for name in names]


def required_union(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """`tool_choice: required` as one schema: a call to any of the tools."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Llguidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.lg, self.lgt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        self.mask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict | None):
        grammar = self.lg.LLMatcher.grammar_from_json_schema(schema or {"type": "object"})
        matcher = self.lg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def first_mask(self, matcher) -> None:
        self.lgt.fill_next_token_bitmask(matcher, self.mask)

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            dt, _ = timed(lambda: self.lgt.fill_next_token_bitmask(matcher, self.mask))
            times.append(dt)
            assert matcher.consume_token(token), matcher.get_error()
        return times


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict | None):
        if schema is None:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        return self.xgr.GrammarMatcher(compiled)

    def first_mask(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.mask)

    def walk(self, matcher, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            dt, _ = timed(lambda: matcher.fill_next_token_bitmask(self.mask))
            times.append(dt)
            assert matcher.accept_token(token), f"token {token} refused"
        return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def itl_round(engine, hf, grammar, constrained: int, round_: int, tokens: int) -> dict[str, list[float]]:
    """8 requests together, the first `constrained` under the grammar; per-row token gaps while all 8 decode."""
    from kvfork.backends.base import SamplingParams
    from kvfork.server.engine.api import GenerateRequest, TokenEvent

    async def one(i: int) -> list[float]:
        question = f"Request {round_ * 8 + i}: the weather in city number {i} as JSON with location, unit and days."
        text = hf.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                      add_generation_prompt=True)
        prompt = hf.encode(text, add_special_tokens=False)
        req = GenerateRequest(f"itl{round_}-{i}", prompt, SamplingParams(), tokens,
                              constraint=grammar if i < constrained else None)
        stamps = []
        async for event in engine.submit(req):
            if isinstance(event, TokenEvent):
                stamps.append(time.perf_counter())
        return stamps

    rows = await asyncio.gather(*(one(i) for i in range(8)))
    start = max(r[0] for r in rows)  # every row has its first token
    end = min(r[-1] for r in rows)  # no row has left yet
    gaps: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for i, stamps in enumerate(rows):
        kind = "constrained" if i < constrained else "unconstrained"
        gaps[kind] += [b - a for a, b in zip(stamps, stamps[1:]) if a >= start and b <= end]
    return gaps


async def measure_itl(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from kvfork.backends import create_backend
    from kvfork.server.engine.config import EngineConfig
    from kvfork.server.engine.loop.engine import Engine
    from kvfork.server.common.state import child_environment
    from kvfork.server.generate.grammar import GrammarCompiler, JsonSchema
    from kvfork.server.watch.metrics import Registry

    hf = AutoTokenizer.from_pretrained(args.model)
    config = EngineConfig(prefix_cache_entries=0, kv_budget_bytes=8 << 30, inference_slots=8)
    engine = Engine(create_backend(args.backend), args.model, args.dtype, config, Registry())
    await engine.start()
    grammar = await GrammarCompiler(hf, engine.info.vocab_size, engine.info.eos_token_ids, 5.0,
                                    child_environment()).compile(
        JsonSchema(TYPICAL_TOOL))
    print(f"{args.model} on {args.backend} ({engine.info.dtype}, {engine.info.device}): 8 rows, "
          f"{args.tokens} tokens each at most")
    await itl_round(engine, hf, grammar, 8, -1, 8)  # warm-up
    totals: dict[int, dict[str, list[float]]] = {n: {"constrained": [], "unconstrained": []} for n in (0, 1, 8)}
    for round_ in range(args.rounds):
        for n in (0, 1, 8):
            for kind, gaps in (await itl_round(engine, hf, grammar, n, round_ * 3 + n, args.tokens)).items():
                totals[n][kind] += gaps
    base = statistics.median(totals[0]["unconstrained"])
    for n, gaps in totals.items():
        for kind, values in gaps.items():
            if values:
                ms = statistics.median(values)
                print(f"  {n} of 8 constrained, {kind} rows: ITL median {ms * 1e3:.2f} ms, p95 "
                      f"{pct(values, 0.95) * 1e3:.2f} ms ({len(values)} gaps), {ms / base:.3f}x the unconstrained batch")
    await engine.shutdown(5)


async def measure_guard(hf, tools: list[dict[str, Any]], repeats: int) -> None:
    import resource

    from kvfork.server.engine.api import Scope
    from kvfork.server.common.state import child_environment
    from kvfork.server.generate.grammar import GrammarCompiler, GrammarError, JsonSchema, grammar_text

    compiler = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=30.0, child_env=child_environment())
    try:
        await compiler.compile(JsonSchema(TYPICAL_TOOL), Scope("warm"))  # the processes' start is not a compile
        await asyncio.gather(*(compiler.compile(JsonSchema(TYPICAL_TOOL), Scope(f"warm{i}")) for i in range(2)))
        wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
        for label, schema in (("typical tool schema", TYPICAL_TOOL), ("agent preset union", required_union(tools)),
                              ("600 optional properties", wide)):
            ask, text = JsonSchema(schema), grammar_text(JsonSchema(schema))
            label = f"{label} ({len(text):,} characters of grammar)"
            plain, guarded = [], []
            for i in range(repeats):  # side by side, alternating
                plain.append(timed(lambda: compiler.build(text, "response_format"))[0])
                t0 = time.perf_counter()
                await compiler.compile(ask, Scope(f"cold-{label}-{i}"))
                guarded.append(time.perf_counter() - t0)
            print(f"  {label}: in the daemon alone {statistics.median(plain) * 1e3:.1f} ms, kvfork's path "
                  f"{statistics.median(guarded) * 1e3:.1f} ms (x{statistics.median(guarded) / statistics.median(plain):.2f})")
    finally:
        compiler.close()
    wide = JsonSchema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}})
    compiler = GrammarCompiler(hf, len(hf), [hf.eos_token_id], timeout_s=0.5, child_env=child_environment())
    try:
        # start both threads' processes (a start is not a grammar's cost): grammars past the threshold, in time
        warm = JsonSchema({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}})
        await asyncio.gather(*(compiler.compile(warm, Scope(f"warm{i}")) for i in range(2)))
        t0 = time.perf_counter()
        try:
            await compiler.compile(wide, Scope("wide"))
            outcome = "compiled"
        except GrammarError:
            outcome = "400"
        waited = time.perf_counter() - t0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu0 = usage.ru_utime + usage.ru_stime
        await asyncio.sleep(2.0)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(f"  3,000 optional properties, 0.5 s timeout: {outcome} after {waited:.2f} s; CPU in this process "
              f"over the next 2 s: {usage.ru_utime + usage.ru_stime - cpu0:.2f} s")
    finally:
        compiler.close()


def main() -> None:
    from transformers import AutoTokenizer

    from kvfork.backends.default_model import default_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder whose tokenizer to use (default: the default model)")
    ap.add_argument("--repeats", type=int, default=5, help="compiles and walks per case; the median is reported")
    ap.add_argument("--itl", action="store_true", help="measure decode ITL in the engine instead")
    ap.add_argument("--backend", default="torch", help="with --itl: the backend")
    ap.add_argument("--dtype", default=None, help="with --itl: the dtype (default: the backend's)")
    ap.add_argument("--tokens", type=int, default=40, help="with --itl: most tokens per request")
    ap.add_argument("--rounds", type=int, default=3, help="with --itl: rounds of (0, 1, 8 constrained)")
    ap.add_argument("--guard", action="store_true", help="kvfork's compile path against the matcher alone")
    args = ap.parse_args()
    args.model = args.model or str(default_model_dir())
    if args.itl:
        asyncio.run(measure_itl(args))
        return
    folder = args.model
    hf = AutoTokenizer.from_pretrained(folder)
    vocab = len(hf)
    tools = agent_tool_schemas()
    print(f"tokenizer {folder} (vocab {vocab}); agent preset: {len(tools)} tools")
    if args.guard:
        asyncio.run(measure_guard(hf, tools, args.repeats))
        return
    # json.dumps' default separators are the ones both engines accept by default.
    docs = {"tool schema": (TYPICAL_TOOL, hf.encode(json.dumps(TYPICAL_DOC), add_special_tokens=False)),
            "json_object": (None, hf.encode(json.dumps(OBJECT_DOC), add_special_tokens=False))}
    compiles = {"agent preset, per tool": [t["parameters"] for t in tools][:1],
                f"agent preset, required over {len(tools)} tools": [required_union(tools)],
                "typical tool schema": [TYPICAL_TOOL]}
    for engine_cls in (Llguidance, Xgrammar):
        dt, engine = timed(lambda: engine_cls(hf, vocab))
        print(f"\n{engine.name}: tokenizer setup {dt * 1e3:.0f} ms")
        for label, schemas in compiles.items():
            runs = [timed(lambda: engine.compile(schemas[0]))[0] for _ in range(args.repeats)]
            ready = [timed(lambda: engine.first_mask(engine.compile(schemas[0])))[0] for _ in range(args.repeats)]
            print(f"  compile {label}: median {statistics.median(runs) * 1e3:.2f} ms; "
                  f"with the first mask {statistics.median(ready) * 1e3:.2f} ms")
        agent_all = [timed(lambda: [engine.compile(t["parameters"]) for t in tools])[0] for _ in range(args.repeats)]
        print(f"  compile all {len(tools)} agent tool schemas one by one: median "
              f"{statistics.median(agent_all) * 1e3:.2f} ms")
        for label, (schema, tokens) in docs.items():
            times: list[float] = []
            for _ in range(args.repeats):
                times += engine.walk(engine.compile(schema), tokens)
            print(f"  mask per token, {label} ({len(tokens)} tokens): median {statistics.median(times) * 1e6:.0f} us, "
                  f"p95 {pct(times, 0.95) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
