"""TEST DOUBLE, not kvfork: a small OpenAI-compatible streaming server for the bench's tests.

It speaks the parts of the protocol the bench and smoke tools read (SSE chunks,
include_usage, cached_tokens, logprobs, /health, /metrics) and takes the
daemon's launch flags, so the tools' real code paths run against it before and
without the real daemon. Its "model" is a hash of the token sequence: greedy
and deterministic. Reuse is bookkeeping only: finished prompts form a prefix
cache; with --active-prefix-reuse-min-tokens > 0, running prompts are donors.
`--perturb-reuse` makes a donor-served answer differ, as a broken engine would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import zlib
from pathlib import Path

import jinja2
from aiohttp import web
from tokenizers import Tokenizer


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Double:
    def __init__(self, args):
        self.args = args
        # tokenizers + the folder's chat template, as transformers' apply_chat_template does it
        # (the tiny models have no BOS), without transformers' seconds of import.
        self.tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
        config = json.loads((Path(args.model) / "tokenizer_config.json").read_text())
        self.template = jinja2.Environment().from_string(config["chat_template"])
        self.finished: list[list[int]] = []
        self.running: dict[int, list[int]] = {}
        self.counters = {"prompt": 0.0, "prefilled": 0.0, "cache": 0.0, "donor": 0.0}

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages=messages, add_generation_prompt=True)
        return self.tok.encode(text, add_special_tokens=False).ids

    def match(self, ids: list[int]) -> tuple[int, str | None]:
        cap = len(ids) - 1  # the last prompt token always runs
        cache = self.finished if self.args.prefix_cache_entries else []
        cached = min(max((common_prefix(ids, p) for p in cache), default=0), cap)
        if self.args.active_prefix_reuse_min_tokens > 0:
            donor = min(max((common_prefix(ids, p) for p in self.running.values()), default=0), cap)
            if donor - cached >= self.args.active_prefix_reuse_min_tokens:
                return donor, "donor"
        return cached, "cache" if cached else None

    def next_token(self, seq: list[int]) -> int:
        return 3 + zlib.crc32(json.dumps(seq[-4:]).encode()) % (self.tok.get_vocab_size() - 3)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        ids = self.chat_ids(body["messages"])
        reused, source = self.match(ids)
        await asyncio.sleep(self.args.prefill_s_per_token * (len(ids) - reused))
        key = id(request)
        self.running[key] = ids
        self.counters["prompt"] += len(ids)
        self.counters["prefilled"] += len(ids) - reused
        if source:
            self.counters[source] += reused
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
        seq = list(ids)
        for i in range(int(body.get("max_tokens", 16))):
            token = self.next_token(seq) + (1 if source == "donor" and self.args.perturb_reuse and i == 0 else 0)
            seq.append(token)
            text = self.tok.decode([token])
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": text, "logprob": -0.5, "bytes": list(text.encode())}]}
            await send({"choices": [choice]})
            await asyncio.sleep(self.args.decode_s)
        del self.running[key]
        self.finished.append(ids)
        await send({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(seq) - len(ids),
                 "prompt_tokens_details": {"cached_tokens": reused}}
        await send({"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def metrics(self, request: web.Request) -> web.Response:
        c = self.counters
        lines = [
            f"kvfork_prompt_tokens_total {c['prompt']}",
            f"kvfork_prefilled_tokens_total {c['prefilled']}",
            f'kvfork_reused_tokens_total{{source="cache"}} {c["cache"]}',
            f'kvfork_reused_tokens_total{{source="donor"}} {c["donor"]}',
        ]
        return web.Response(text="\n".join(lines) + "\n")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(double: Double) -> web.Application:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", double.chat)
    app.router.add_get("/metrics", double.metrics)
    app.router.add_get("/health", health)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--active-prefix-reuse-min-tokens", type=int, default=0)
    p.add_argument("--no-follow", action="store_true")
    p.add_argument("--prefix-cache-entries", type=int, default=16)
    p.add_argument("--prefill-s-per-token", type=float, default=0.0002)
    p.add_argument("--decode-s", type=float, default=0.01)
    p.add_argument("--perturb-reuse", action="store_true")
    p.add_argument("--speculative", default="off")  # taken, not acted on: the double has no verify pass
    return p.parse_args(argv)


def main() -> None:
    double = Double(parse_args())
    web.run_app(make_app(double), host="127.0.0.1", port=double.args.port, print=None)


if __name__ == "__main__":
    main()
